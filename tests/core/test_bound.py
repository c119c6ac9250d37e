"""llmserve_bench/bound.py's arithmetic: the floor of a decode step from bytes, params, bandwidth and GEMM rate."""

from llmserve_bench.bound import Probe, bound_report, decode_bound, step_bound


def test_memory_binds_at_batch_one():
    # 100 MB of weights + 1000 tokens × 10 kB of KV at 10 GB/s: 11 ms; compute 2 × 50 M × 1 / 100 GFLOP/s = 1 ms
    b = step_bound(weight_bytes=100_000_000, kv_bytes_per_token=10_000, matmul_params=50_000_000, batch=1,
                   context_tokens=1000, bandwidth=10e9, gemm_rate=100e9)
    assert abs(b["memory_s"] - 0.011) < 1e-12
    assert abs(b["compute_s"] - 0.001) < 1e-12
    assert b["bound_s"] == b["memory_s"] and b["binds"] == "memory"


def test_compute_binds_at_a_large_batch():
    # batch 64: compute 2 × 50 M × 64 / 100 GFLOP/s = 64 ms; memory (100 MB + 64 × 100 × 10 kB) / 10 GB/s = 16.4 ms
    b = step_bound(100_000_000, 10_000, 50_000_000, batch=64, context_tokens=6400, bandwidth=10e9, gemm_rate=100e9)
    assert abs(b["compute_s"] - 0.064) < 1e-12
    assert abs(b["memory_s"] - 0.0164) < 1e-12
    assert b["bound_s"] == b["compute_s"] and b["binds"] == "compute"


def test_decode_bound_groups_steps_by_batch():
    fp = {"weight_bytes": 100_000_000, "matmul_params": 50_000_000, "kv_bytes_per_token": 10_000}
    p = Probe(bandwidth_readings=[8e9, 10e9], gemm_readings=[100e9, 50e9], gemm_shape=(2, 8, 32), dtype="float32",
              threads=1, seconds=0.0)  # the best readings bound: 10 GB/s, 100 GFLOP/s
    steps = [(1, 1000, 0.020), (1, 1000, 0.024), (1, 1000, 0.022), (2, 0, 0.050)]
    r = decode_bound(steps, fp, p)
    one, two = r["by_batch"]
    assert (one["batch"], one["steps"], one["context_mean"]) == (1, 3, 1000)
    assert abs(one["step_p50_ms"] - 22.0) < 1e-9 and abs(one["bound_ms"] - 11.0) < 1e-9
    assert abs(one["ratio"] - 2.0) < 1e-9 and one["binds"] == "memory"
    assert abs(one["read_gbs"] - 5.0) < 1e-9  # the floor's 110 MB in the step's 22 ms
    assert abs(two["bound_ms"] - 10.0) < 1e-9 and abs(two["ratio"] - 5.0) < 1e-9  # memory 10 ms vs compute 2 ms
    assert r["probe"]["bandwidth_gbs"] == 10.0 and r["footprint"] == fp
    assert not r["probe"]["unsteady"]  # 8 and 10 GB/s: within 1.25×


def test_a_run_whose_bandwidth_moved_between_the_probes_is_marked(capsys):
    from llmserve_bench.bound import print_decode_bound

    fp = {"weight_bytes": 100_000_000, "matmul_params": 50_000_000, "kv_bytes_per_token": 10_000}
    p = Probe(bandwidth_readings=[88e9, 52e9], gemm_readings=[100e9], gemm_shape=(2, 8, 32), dtype="float32",
              threads=2, seconds=0.0)
    r = decode_bound([(1, 100, 0.002)], fp, p)
    assert r["probe"]["unsteady"] and r["probe"]["bandwidth_gbs"] == 88.0  # still the best reading
    print_decode_bound(r)
    assert "moved between the probes (88.0, 52.0 GB/s)" in capsys.readouterr().out


def test_bound_is_skipped_when_the_backend_does_not_say_what_a_step_reads():
    assert "skipped" in bound_report([(1, 10, 0.01)], {"backend": "fake", "dtype": "float32", "hidden_size": 8})
    assert bound_report([(1, 10, 0.01)], {}, skip=True) == {"skipped": "--no-bound"}
