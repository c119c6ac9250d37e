"""The model's own defaults over HTTP: every EOS id ends a sequence, sampling defaults fill omitted fields.

The fake backend's options stand in for a checkpoint's generation_config.json (tests/torch/
test_generation_config.py reads real files); model.generation_config: none turns the defaults off.
"""

from __future__ import annotations

import pytest
from llmserve_fake import next_token

from llmserve.engine import Engine
from tests.server.conftest import FAKE, start_server

CHAT = [{"role": "user", "content": "hi"}]
PROMPT = list(b"user: hi\nassistant:")  # the byte tokenizer's rendering of CHAT


def _free_run(ids: list[int], n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(next_token(ids, len(ids), 257, None))
        ids.append(out[-1])
    return out


RUN = _free_run(PROMPT, 12)
EXTRA_EOS = RUN[2]  # a second EOS id: the chat above ends at its third token
assert EXTRA_EOS not in RUN[:2] and 256 not in RUN[:3]
DEFAULTS = {"max_tokens": 5, "temperature": 0.25, "top_k": 7}


def _config(generation_config: str) -> dict:
    return FAKE | {"backend": {"name": "fake", "options": {"eos_token_id": [256, EXTRA_EOS],
                                                           "generation_defaults": DEFAULTS}},
                   "model": FAKE["model"] | {"max_model_len": 64, "generation_config": generation_config}}


@pytest.fixture(scope="module", params=["auto", "none"])
def server(request):
    s = start_server(_config(request.param))
    seen = []  # the SamplingParams each sequence reached the backend with
    execute = s.engine.backend.execute
    s.engine.backend.execute = lambda batch: (seen.extend(r.sampling for r in batch.requests), execute(batch))[1]
    s.seen = seen
    yield s
    s.stop()


def _chat(server, **kw):
    server.seen.clear()
    r = server.client().chat.completions.create(model="embedded", messages=CHAT, **kw)
    return r, server.seen[-1]


def test_every_eos_id_ends_the_sequence_with_or_without_the_defaults(server):
    r, _ = _chat(server, max_tokens=10)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] is None  # an EOS, not a stop_token_ids entry
    r, _ = _chat(server, max_tokens=10, extra_body={"min_tokens": 4})  # min_tokens holds every EOS id back
    assert r.usage.completion_tokens >= 4


def test_omitted_fields_take_the_models_defaults_and_given_ones_win(server):
    auto = server.engine.config.model.generation_config == "auto"
    r, sp = _chat(server, extra_body={"ignore_eos": True})
    # the model's max_tokens default, else up to the context (64 tokens, 19 of them the prompt)
    assert r.usage.completion_tokens == (5 if auto else 64 - len(PROMPT))
    assert r.choices[0].finish_reason == "length"
    assert (sp.temperature, sp.top_k) == ((0.25, 7) if auto else (1.0, 0))
    r, sp = _chat(server, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True, "top_k": 3})
    assert r.usage.completion_tokens == 8 and (sp.temperature, sp.top_k) == (1.0, 3)
    r, sp = _chat(server, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2 and sp.temperature == (0.25 if auto else 1.0)


def test_the_models_max_tokens_default_is_capped_by_the_room_the_prompt_leaves(server):
    auto = server.engine.config.model.generation_config == "auto"
    for n, left in ((40, 7), (44, 3)):  # the prompt is 17 + n tokens of 64
        long = [{"role": "user", "content": "x" * n}]
        r = server.client().chat.completions.create(model="embedded", messages=long, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == 17 + n and r.usage.completion_tokens == (min(5, left) if auto else left)


def test_offline_generate_without_params_takes_the_models_defaults():
    cfg = _config("auto")
    cfg["backend"]["options"]["generation_defaults"] = {"max_tokens": 3, "ignore_eos": True}
    eng = Engine.from_config(cfg | {"tokenizer": {"name": "none"}})
    try:
        assert eng.generate([[1, 2, 3]]) == [_free_run([1, 2, 3], 3)]
    finally:
        eng.shutdown()


def test_models_shows_the_sampling_an_omitted_field_gets_and_where_it_comes_from(server):
    auto = server.engine.config.model.generation_config == "auto"
    (card,) = server.client().models.list().data
    assert card.model_extra["sampling_defaults"] == (
        {"temperature": 0.25, "top_p": 1.0, "top_k": 7, "min_p": 0.0, "repetition_penalty": 1.0,
         "source": "backend.options.generation_defaults"} if auto else
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
         "source": "the OpenAI API's defaults"})


def test_a_requests_temperature_zero_stays_greedy_over_the_models_default(server):
    _, sp = _chat(server, max_tokens=2, temperature=0)
    assert sp.temperature == 0.0
