#!/usr/bin/env bash
# One sitting on a lent NVIDIA GPU (no package index there): install the wheels carried in .whl/, check the
# machine, run the CUDA tests, then the nano-vllm workload benchmark. Everything lands in $OUT (or ./gpu-out).
#   bash benchmarks/gpu/session.sh [extra args for gpu_nanovllm.py]
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=${SITE:-$(mktemp -d)}  # where the carried wheels are installed (a fresh directory unless SITE is set)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || exit 1
  export PYTHONPATH=$SITE
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/plugins PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-150}" python3 -m pytest -q -x -p no:cacheprovider -p no:randomly tests/torch/test_cuda.py \
  tests/torch/test_triton.py 2>&1 | tee "$OUT/tests.log" | tail -15
echo "tests done at +$(( $(date +%s) - T0 ))s"
timeout "${BENCH_S:-330}" python3 benchmarks/gpu_nanovllm.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" \
  | grep -v "it/s\]" | tail -40
echo "bench done at +$(( $(date +%s) - T0 ))s"
