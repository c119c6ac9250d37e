"""Request fields over HTTP: refused ones, truncate_prompt_tokens, return_tokens_as_token_ids, and the logprobs fixes."""

from __future__ import annotations

import httpx
import pytest

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["pkg.fn"]}),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_field_that_would_change_the_output_is_refused_before_anything_runs(fake_server, path, body, stream):
    r = httpx.post(fake_server.url + path, json=body | {"stream": stream}, timeout=10)
    field = next(k for k in body if k not in ("prompt", "messages"))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"
    # the same field at its no-op value is accepted
    ok = httpx.post(fake_server.url + path, json=body | {field: {"use_beam_search": False, "logits_processors": [],
                                                                 "echo": False, "modalities": ["text"]}[field],
                                                         "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(fake_server):
    client = fake_server.client()
    r = client.completions.create(model="embedded", prompt="abcdefgh", max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text.startswith("fgh")  # echo shows what the model got
    same = client.completions.create(model="embedded", prompt="fgh", max_tokens=2, echo=True)
    assert r.choices[0].text == same.choices[0].text
    r = client.chat.completions.create(model="embedded", messages=CHAT, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    # -1: as many as the context holds with room for max_tokens (512 here)
    r = client.completions.create(model="embedded", prompt="y" * 600, max_tokens=12,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 500
    for k, status in ((513, 400), (0, 400)):
        resp = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": k})
        assert resp.status_code == status and resp.json()["error"]["param"] == "truncate_prompt_tokens"
    resp = httpx.post(fake_server.url + "/v1/completions",  # -1 with max_tokens that leaves no room: said so
                      json={"prompt": "x", "truncate_prompt_tokens": -1, "max_tokens": 5000})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text


def test_return_tokens_as_token_ids_names_tokens_by_id(fake_server):
    client = fake_server.client()
    r = client.completions.create(model="embedded", prompt="ab", max_tokens=3, logprobs=1, echo=True,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens[:2] == ["token_id:97", "token_id:98"] and all(t.startswith("token_id:") for t in lp.tokens)
    assert all(set(top) <= {t for t in lp.tokens} | {f"token_id:{i}" for i in range(257)} for top in lp.top_logprobs[1:])
    r = client.chat.completions.create(model="embedded", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    for e in r.choices[0].logprobs.content:
        assert e.token.startswith("token_id:") and e.bytes == list(e.token.encode())
        assert all(t.token.startswith("token_id:") for t in e.top_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_sends_the_prompts_logprobs_once(fake_server, stream):
    # two prompt tokens and ten decode steps: the prompt's logprobs once, then one entry per output token
    kw = dict(model="embedded", prompt="ab", max_tokens=10, logprobs=1, echo=True, extra_body={"ignore_eos": True})
    client = fake_server.client()
    if stream:
        tokens, lps = [], []
        for c in client.completions.create(stream=True, **kw):
            if c.choices and c.choices[0].logprobs:
                tokens += c.choices[0].logprobs.tokens
                lps += c.choices[0].logprobs.token_logprobs
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, lps = lp.tokens, lp.token_logprobs
    assert len(tokens) == 2 + 10 and tokens[:2] == ["a", "b"]
    assert lps[0] is None and all(x is not None for x in lps[1:])


def test_logprobs_zero_still_lists_the_chosen_token(fake_server):
    client = fake_server.client()
    lp = client.completions.create(model="embedded", prompt="abc", max_tokens=4, logprobs=0, echo=True,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.top_logprobs[0] is None
    for tok, value, top in list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))[1:]:
        assert top == {tok: value}
    # chat, as OpenAI and vLLM answer top_logprobs 0: the chosen token is the entry itself, no alternatives
    r = client.chat.completions.create(model="embedded", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=0)
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in r.choices[0].logprobs.content)


def test_prompt_logprobs_come_back_in_vllms_shape(fake_server):
    client = fake_server.client()
    r = client.completions.create(model="embedded", prompt=["abcd", "xy"], max_tokens=2, n=2,
                                  extra_body={"prompt_logprobs": 1})
    for c in r.choices:
        plp, prompt = c.model_extra["prompt_logprobs"], ("abcd", "xy")[c.index // 2]
        assert len(plp) == len(prompt) and plp[0] is None
        for ch, d in zip(prompt[1:], plp[1:]):
            # the prompt token itself first (the fake model gives it logprob -1, rank 1), then the top N
            assert next(iter(d.items())) == (str(ord(ch)), {"logprob": -1.0, "rank": 1, "decoded_token": ch})
    assert client.completions.create(model="embedded", prompt="ab", max_tokens=1).choices[0].model_extra[
        "prompt_logprobs"] is None
    resp = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "ab", "prompt_logprobs": 1, "stream": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_logprobs_list_the_token_then_its_top_alternatives_with_their_ranks():
    from llmserve.request import Logprob
    from llmserve.server.logprobs import TokenText, prompt_logprobs

    got = prompt_logprobs(TokenText(None), [None, Logprob(98, -2.0, 3, [(97, -0.5), (99, -1.0), (98, -2.0)])])
    assert got[0] is None and list(got[1].items()) == [
        ("98", {"logprob": -2.0, "rank": 3, "decoded_token": "token_id:98"}),
        ("97", {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:97"}),
        ("99", {"logprob": -1.0, "rank": 2, "decoded_token": "token_id:99"})]
