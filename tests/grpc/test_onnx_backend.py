"""The onnx backend: the exported decoder's greedy tokens equal the torch backend's on the tiny checkpoints, in
process and behind `llmserve worker --backend onnx`; the export is cached; /stats says how it pages."""

from __future__ import annotations

import math

import pytest

from llmserve.engine import Engine
from llmserve.request import SamplingParams
from tests.grpc.conftest import start_worker
from tests.server.conftest import start_server

# the first two share two blocks of 4 (a prefix-cache hit the backend must read from blocks another sequence wrote)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 40, 41], [60, 61, 62]]


def _config(model, backend: str, **extra) -> dict:
    return {"model": {"model": str(model), "dtype": "float32"},
            "backend": {"name": backend, "kv_cache_memory": "8MiB"}, "cache": {"block_size": 4}, **extra}


def _generate(model, backend: str):
    """Each prompt's greedy tokens, one prompt after another (the second reads the first's cached blocks), then the
    prompt logprobs of the second; and the engine's stats (no tokenizer: token ids in and out)."""
    eng = Engine.from_config(_config(model, backend, tokenizer={"name": "none"}))
    toks = [eng.generate([p], SamplingParams(max_tokens=16, temperature=0.0, detokenize=False))[0] for p in PROMPTS]
    rid = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                                     detokenize=False))
    plp = None
    while eng.has_unfinished:
        plp = next((o.prompt_logprobs for o in eng.step().outputs if o.request_id == rid and o.prompt_logprobs),
                   plp)
    stats = eng.stats()
    eng.shutdown()
    return toks, plp, stats


@pytest.mark.parametrize("checkpoint", ["gpt2_dir", "qwen2_chat"])
def test_greedy_tokens_equal_the_torch_backends(checkpoint, request, onnx_cache):
    model = request.getfixturevalue(checkpoint)
    got, got_plp, stats = _generate(model, "onnx")
    want, want_plp, _ = _generate(model, "torch")
    assert got == want
    assert all(len(set(t)) > 3 for t in got)  # the tiny model's output varies: the comparison means something
    assert stats["cache"]["prefix_hits"] > 0  # the second prompt's first blocks were the first's
    assert [x and x.token_id for x in got_plp] == [x and x.token_id for x in want_plp] == [None, *PROMPTS[1][1:]]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(got_plp[1:], want_plp[1:]))
    b = stats["backend"]
    assert b["backend"] == "onnx" and "block" in b["paging"] and b["kv_block_size"] == 4


def test_the_export_is_made_once_and_read_from_the_cache(gpt2_dir, onnx_cache, monkeypatch):
    from llmserve_onnx import export

    first = export.exported(_model_config(gpt2_dir))
    monkeypatch.setattr(export, "_write", lambda *a: pytest.fail("exported again"))
    again = export.exported(_model_config(gpt2_dir))
    assert again.path == first.path and first.decoder.exists() and first.head.exists()
    assert str(first.path).startswith(onnx_cache["LLMSERVE_CACHE"])


def _model_config(model):
    from llmserve.config import config_from_dict

    return config_from_dict(_config(model, "onnx")).model


def test_the_onnx_backend_behind_a_worker_gives_the_torch_backends_text(qwen2_chat, onnx_env):
    proc, address = start_worker("--backend", "onnx", "--model", str(qwen2_chat), "--kv-cache-memory", "8MiB",
                                 env=onnx_env)
    server = start_server({**_config(qwen2_chat, "grpc"), "backend": {"name": "grpc", "options": {"address": address}}})
    try:
        eng = Engine.from_config(_config(qwen2_chat, "torch"))
        prompt = "The capital of France is"
        want = eng.tokenizer.decode(eng.generate([eng.tokenizer.encode(prompt)],
                                                 SamplingParams(max_tokens=12, temperature=0.0))[0])
        eng.shutdown()
        r = server.client(api_key="x").completions.create(model=server.state.config.served_model_name, prompt=prompt,
                                                          max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        worker = server.stats()["backend"]["worker"]
        assert worker["backend"] == "onnx" and "gathered from its KV blocks" in worker["paging"]
    finally:
        server.stop()
        proc.kill()
