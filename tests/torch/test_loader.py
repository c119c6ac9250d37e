"""Loading: sharded safetensors and .bin, dtypes, dummy weights, offline hub ids, KV budget, options."""

from __future__ import annotations

import json
import os
import platform

import pytest
import torch
from torch_helpers import Driver, batch_of, backend_config, make_backend, make_gpt2, make_qwen2

from llmserve.config import config_from_dict
from llmserve.errors import ConfigError


def _logits(b, ids):
    return b.compute_logits(batch_of([Driver(b).request("x", ids, 0, len(ids))]))


def _hf(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def save_bin(model, path, shards: int = 1) -> None:
    """Write a PyTorch .bin checkpoint (transformers 5 only writes safetensors), sharded with an index if asked."""
    model.config.save_pretrained(path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
          or not model.config.tie_word_embeddings}
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin")
        return
    names = sorted(sd)
    weight_map = {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: sd[k] for k in names[i::shards]}
        torch.save(part, path / fname)
        weight_map.update({k: fname for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_sharded_checkpoints_load(tmp_path, safe):
    hf = make_qwen2(seed=7)
    if safe:
        hf.save_pretrained(tmp_path, max_shard_size="100KB")
    else:
        save_bin(hf, tmp_path, shards=3)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert (tmp_path / index).is_file()
    assert len(list(tmp_path.glob("*.safetensors" if safe else "*.bin"))) > 1
    b = make_backend(str(tmp_path))
    assert b.loaded.weights.count(",") >= 1  # read every shard
    ids = list(range(1, 20))
    torch.testing.assert_close(_logits(b, ids), _hf(hf, ids), atol=2e-4, rtol=1e-4)


def test_single_bin_file_loads(tmp_path):
    hf = make_gpt2(seed=8)
    save_bin(hf, tmp_path)
    b = make_backend(str(tmp_path), load_format="pt")
    assert b.loaded.weights == "pytorch_model.bin"
    ids = list(range(5, 25))
    torch.testing.assert_close(_logits(b, ids), _hf(hf, ids), atol=2e-4, rtol=1e-4)


def test_load_format_that_finds_no_files_says_so(gpt2_dir):
    path, _ = gpt2_dir
    with pytest.raises(ConfigError, match="no weights"):
        make_backend(str(path), load_format="pt")


@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                        ("float32", torch.float32)])
def test_dtypes(qwen2_dir, dtype, want):
    path, hf = qwen2_dir
    b = make_backend(str(path), dtype=dtype)
    assert b.dtype == want and b.model.embed.dtype == want and b.kv.k.dtype == want
    assert b.describe()["dtype"] == dtype
    ids = list(range(2, 30))
    got = _logits(b, ids)
    assert got.dtype == torch.float32
    ref = _hf(hf, ids)
    tol = 1e-4 if want == torch.float32 else 5e-2
    assert (got - ref).abs().max() < tol * max(1.0, ref.abs().max().item())


def test_the_default_dtype_is_auto_on_every_device(monkeypatch):
    """One default everywhere (issue 35.4): the CLI, the config and `make serve` all serve what the CPU runs fast."""
    from llmserve.config import ModelConfig
    from llmserve_torch.loader import resolve_dtype

    assert ModelConfig().dtype == "auto"
    for bf16 in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert resolve_dtype(None, torch.device("cpu")) == resolve_dtype("auto", torch.device("cpu"))
        assert resolve_dtype(None, torch.device("cpu"))[0] == (torch.bfloat16 if bf16 else torch.float32)


@pytest.mark.parametrize("bf16, amx, want, words", [
    (True, False, torch.bfloat16, "AVX512_BF16"),
    (False, True, torch.bfloat16, "AMX"),
    (False, False, torch.float32, "neither AVX512_BF16 nor AMX"),
])
def test_auto_dtype_is_what_the_cpu_runs_natively(monkeypatch, tmp_path, bf16, amx, want, words):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    make_gpt2(seed=9).to(torch.bfloat16).save_pretrained(tmp_path)  # the checkpoint's dtype does not decide
    d = make_backend(str(tmp_path), dtype="auto").describe()
    assert d["dtype"] == str(want).replace("torch.", "") and words in d["dtype_reason"]
    assert d["dtype_reason"].startswith("auto: ")
    assert make_backend(str(tmp_path), dtype="float32").describe()["dtype_reason"] == "asked for"


def test_dummy_weights_are_seeded(gpt2_dir):
    path, _ = gpt2_dir
    ids = list(range(30))
    a = _logits(make_backend(str(path), load_format="dummy", seed=1), ids)
    b = _logits(make_backend(str(path), load_format="dummy", seed=1), ids)
    c = _logits(make_backend(str(path), load_format="dummy", seed=2), ids)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_offline_hub_id_explains_how_to_use_a_local_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to fall back on
    with pytest.raises(ConfigError) as e:
        make_backend("some-org/some-model-that-is-not-cached")
    msg = str(e.value)
    assert "offline" in msg and "some-org/some-model-that-is-not-cached" in msg
    assert "--model" in msg and "local" in msg


def test_an_unreachable_hub_fails_within_seconds_with_the_way_out(tmp_path):
    """No HF_HUB_OFFLINE, no network: the hub endpoint (a closed local port here) refuses, and we say so fast."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends: nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", "from llmserve.engine import Engine; "
                        "Engine.from_config({'model': {'model': 'some-org/not-cached'}})"],
                       capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0 and "some-org/not-cached" in p.stderr and "--model" in p.stderr, p.stderr[-2000:]
    assert "offline" in p.stderr and elapsed < 30


def test_missing_directory_and_unsupported_architecture(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        make_backend(str(tmp_path / "nope") + "/")
    from transformers import T5Config  # (BERT is supported since the encoder family: an encoder-decoder is not)

    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=37).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not supported"):
        make_backend(str(tmp_path))


def test_embedded_model_is_small_seeded_and_byte_level():
    b = make_backend("embedded")
    a = b.arch
    assert (a.vocab_size, b.eos_token_id, b.max_model_len) == (257, 256, 1024)
    assert a.num_layers <= 6 and 64 <= a.hidden_size <= 128
    ids = list(b"deterministic")
    assert torch.equal(_logits(b, ids), _logits(make_backend("embedded"), ids))


def test_parse_bytes():
    from llmserve_torch.kv_cache import parse_bytes

    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 2**30
    assert parse_bytes(1000) == 1000
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_kv_budget_in_bytes_and_as_a_fraction(gpt2_dir):
    from llmserve_torch.backend import TorchBackend
    from llmserve_torch.kv_cache import bytes_per_block

    path, _ = gpt2_dir
    cfg = backend_config(str(path))
    cfg.backend.kv_cache_memory = "1MiB"
    cfg.backend.options["cap_kv_blocks"] = False
    b = TorchBackend(cfg)
    per = bytes_per_block(b.arch, 16, torch.float32)
    assert per == 2 * 2 * 16 * 4 * 16 * 4  # K+V, 2 layers, 16 tokens, 4 heads × 16 dims, fp32
    assert b.num_kv_blocks(16) == 2**20 // per
    cfg.backend.kv_cache_memory = 0.001
    assert TorchBackend(cfg).num_kv_blocks(16) >= 1
    cfg.backend.kv_cache_memory = "lots"
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        TorchBackend(cfg).num_kv_blocks(16)
    # the default cap: no more blocks than max_num_seqs full-length sequences can use
    cfg.backend.kv_cache_memory = "1GiB"
    cfg.backend.options["cap_kv_blocks"] = True
    assert TorchBackend(cfg).num_kv_blocks(16) == 64 * (256 // 16) + 1


def test_options_are_checked():
    from llmserve_torch.backend import TorchBackend

    with pytest.raises(ConfigError, match="unknown option.*atention"):
        TorchBackend(config_from_dict({"backend": {"options": {"atention": "cpu"}}}))
    with pytest.raises(ConfigError, match="attention"):
        make_backend("embedded", attention="flash")


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        make_backend("embedded", device="cuda")


def test_without_a_compiler_auto_falls_back_with_a_warning_and_cpu_is_a_clear_error(monkeypatch, tmp_path, caplog):
    import logging

    from llmserve_torch import kernel_library

    monkeypatch.setattr(kernel_library, "_lib", None)
    monkeypatch.setattr(kernel_library, "_error", None)
    monkeypatch.setattr(kernel_library, "PREBUILT", tmp_path / "no-prebuilt")  # (as in a source tree)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "kernels"))
    with caplog.at_level(logging.INFO, logger="llmserve.torch"):
        b = make_backend("embedded")
    assert b.attention.name == "reference" and b.sampler.fast_argmax is None
    # one WARNING, naming what is missing, what runs instead and the fix
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "could not be built" in warned[0] and "no-such-compiler" in warned[0] and "slower" in warned[0] \
        and "install a C++ compiler" in warned[0]
    # and /stats says so too
    assert "no-such-compiler" in b.describe()["kernel_library"]["unavailable"]
    out = b.execute(batch_of([Driver(b).request("a", list(b"hi there"), 0, 8)]))
    assert len(out.sampled_token_ids) == 1 and 0 <= out.sampled_token_ids[0] < 257
    with pytest.raises(ConfigError, match="cpu kernel cannot be used"):
        make_backend("embedded", attention="cpu")


@pytest.mark.slow
def test_compiling_the_cpu_kernels_is_announced_once(monkeypatch, tmp_path, caplog):
    """A first start compiles csrc/ for a while: a line says so before (and how long after); a cached build is silent."""
    import logging

    from llmserve_torch import kernel_library

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "kernels"))
    # the scalar build: seconds, not the native one's minute (what is tested is the announcement, not the kernels)
    monkeypatch.setenv("LLMSERVE_KERNEL_MARCH", "x86-64" if platform.machine() == "x86_64" else "armv8-a")
    for _ in range(2):
        monkeypatch.setattr(kernel_library, "_lib", None)
        monkeypatch.setattr(kernel_library, "_error", None)
        with caplog.at_level(logging.INFO, logger="llmserve.torch"):
            kernel_library.load()
    lines = [r.getMessage() for r in caplog.records if "CPU kernels" in r.getMessage()]
    assert len(lines) == 2, lines  # the first build only; the second loads the cached library
    assert lines[0].startswith("compiling the CPU kernels") and str(tmp_path / "kernels") in lines[0]
    assert lines[1].startswith("compiled the CPU kernels in ")
