"""POST /v1/generate (the llmserve_generate route plugin): a plain JSON body in, text, ids, counts, timings out."""

from __future__ import annotations

import httpx
import pytest

from llmserve_fake import next_token


def post(server, body, **kw):
    return httpx.post(server.url + "/v1/generate", json=body, timeout=10, **kw)


def _fake_tokens(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks, len(toks), 257, 256))
    return toks[len(prompt):]


def test_generate_answers_text_ids_counts_and_timings(fake_server):
    r = post(fake_server, {"prompt": "hello", "max_new_tokens": 7, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    want = _fake_tokens(list(b"hello"), 7)
    assert d["token_ids"] == want and d["generated_tokens"] == 7 and d["prompt_tokens"] == 5
    assert d["text"] == bytes(t for t in want if t < 256).decode("utf-8", errors="replace")
    assert d["finish_reason"] == "length" and d["model"] == "embedded" and d["id"].startswith("gen-")
    t = d["timings"]
    assert 0 < t["first_token_s"] <= t["total_s"] and t["decode_tokens_per_s"] > 0
    # the same tokens as /v1/completions gives for the same body
    c = fake_server.client().completions.create(model="embedded", prompt="hello", max_tokens=7, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert c.choices[0].text == d["text"]
    # token ids as the prompt; a stop token ends it early, the counts say so
    r = post(fake_server, {"prompt": [104, 105], "max_new_tokens": 20, "ignore_eos": True,
                           "stop_token_ids": [_fake_tokens([104, 105], 3)[2]]}).json()
    assert r["generated_tokens"] == 3 and r["finish_reason"] == "stop" and r["prompt_tokens"] == 2
    assert fake_server.wait_idle()["cache"]["used_blocks"] == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_new_tokens": "ten"}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 10**30}, "max_new_tokens"),
    ({"prompt": "hi", "max_tokens": 5}, "max_tokens"),
    ({"prompt": "hi", "stream": True}, "stream"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": [], "max_new_tokens": 2}, "prompt"),
    ({"prompt": [1, [2]]}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"max_new_tokens": 2}, "prompt"),
])
def test_a_bad_body_gets_a_400_in_openais_shape(fake_server, body, param):
    r = post(fake_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_not_json_a_lone_surrogate_and_a_wrong_model_are_refused(fake_server):
    r = httpx.post(fake_server.url + "/v1/generate", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(fake_server.url + "/v1/generate", content=b'{"prompt": "a\\ud800b", "max_new_tokens": 2}',
                   timeout=10, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text  # never a 500
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = post(fake_server, {"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_generate_is_in_the_openapi_document(fake_server):
    doc = httpx.get(fake_server.url + "/openapi.json", timeout=10).json()
    op = doc["paths"]["/v1/generate"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"prompt", "max_new_tokens", "temperature", "top_p", "seed"} <= set(schema["properties"])
    assert "/v1/completions" in doc["paths"] and "CompletionRequest" in doc["components"]["schemas"]
