"""POST /v1/embeddings against real servers with real clients: the openai SDK's embeddings.create and LangChain's
OpenAIEmbeddings on a tiny Qwen2 (last-token pooling) and a tiny BERT (an encoder: embeddings only), beside a
streaming generation; Matryoshka dimensions, truncation and fan-out on the fake backend; hostile bodies."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import math
import os
import struct
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import FAKE, start_server
from tests.server.test_fuzz import encode, from_schema, mutated

ERROR_KEYS = {"message", "type", "param", "code"}


def unit(v: list[float]) -> bool:
    return math.isclose(math.sqrt(math.fsum(x * x for x in v)), 1.0, rel_tol=1e-5)


def refused(r: httpx.Response, status: int = 400, param: str | None = None) -> str:
    """The error body's message, after checking the status and OpenAI's error shape (and param, if given)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def torch_server(d, name: str, **attrs):
    """A float32 torch-backend server on the checkpoint in d (float32: compared with transformers'), served as
    `name`, with `dir` and `attrs` set on it; stopped after the module."""
    s = start_server({"model": {"model": str(d), "served_model_name": name, "dtype": "float32"},
                      "backend": {"name": "torch", "kv_cache_memory": "16MiB"}})
    s.dir = d
    for k, v in attrs.items():
        setattr(s, k, v)
    yield s
    s.stop()


# --- a decoder: the tiny Qwen2 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("torch")
    from tests.server.tool_helpers import save_byte_tokenizer
    from tests.torch.torch_helpers import make_qwen2

    d = tmp_path_factory.mktemp("qwen")
    tok = save_byte_tokenizer(d)  # (tool_helpers' tiny Qwen2, in float32 to compare with transformers')
    make_qwen2(seed=3, vocab_size=len(tok)).save_pretrained(d)
    yield from torch_server(d, "tiny-qwen")


def test_the_sdk_embeds_texts_and_token_ids_with_the_models_last_token_state(qwen):
    import torch
    import transformers

    client = qwen.client()
    r = client.embeddings.create(model="tiny-qwen", input=["hello", "world", "hello"])  # the SDK asks for base64
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny-qwen"
    assert all(len(v) == 64 and unit(v) for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    ids = httpx.post(qwen.url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert r.usage.prompt_tokens == r.usage.total_tokens == 2 * len(ids) + len("world")  # a byte a token
    as_ids = client.embeddings.create(model="tiny-qwen", input=[ids], encoding_format="float")
    assert as_ids.data[0].embedding == vecs[0]  # float and base64 carry the same float32 values
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen.dir).eval()
    with torch.no_grad():
        ref = torch.nn.functional.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
    torch.testing.assert_close(torch.tensor(vecs[0]), ref, atol=2e-5, rtol=1e-4)


def test_base64_is_the_float_answer_as_little_endian_float32(qwen):
    body = {"model": "tiny-qwen", "input": ["the cat", "a dog"]}
    f = httpx.post(qwen.url + "/v1/embeddings", json=body | {"encoding_format": "float"}).json()
    b = httpx.post(qwen.url + "/v1/embeddings", json=body | {"encoding_format": "base64"}).json()
    for x, y in zip(f["data"], b["data"]):
        raw = base64.b64decode(y["embedding"])
        assert len(raw) == 4 * 64 and list(struct.unpack("<64f", raw)) == x["embedding"]


def test_langchain_openai_embeddings(qwen):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="tiny-qwen", base_url=qwen.url + "/v1", api_key="unused",
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(["Paris is the capital of France.", "The weather today.",
                                "Paris is the capital of France."])
    assert [len(d) for d in docs] == [64, 64, 64] and docs[0] == docs[2] and docs[0] != docs[1]
    assert all(unit(d) for d in docs)
    assert emb.embed_query("Paris is the capital of France.") == docs[0]


def test_embeddings_run_in_the_steps_of_a_streaming_generation_and_change_neither(qwen):
    client = qwen.client()
    texts = [f"document number {i}: " + "lorem ipsum " * (i + 1) for i in range(6)]
    alone = [d.embedding for d in client.embeddings.create(model="tiny-qwen", input=texts).data]
    kw = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300,
          "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces, ended = [], []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = client.chat.completions.create(stream=True, **kw)
        pieces.append(next(iter(stream)).choices[0].delta.content or "")  # the generation is running now
        # three requests at once, one holding several inputs: each a batch of sequences for the engine
        futs = [pool.submit(client.embeddings.create, model="tiny-qwen", input=part)
                for part in (texts[:1], texts[1:4], texts[4:])]
        got = [d.embedding for f in futs for d in f.result().data]
        embedded_at = time.monotonic()
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
        ended.append(time.monotonic())
    assert embedded_at < ended[0]  # the embeddings were answered while the generation still streamed
    assert got == alone
    assert "".join(pieces) == whole
    assert qwen.wait_idle()["cache"]["used_blocks"] == 0


def test_a_model_not_trained_for_it_refuses_dimensions_naming_its_size(qwen):
    r = httpx.post(qwen.url + "/v1/embeddings", json={"input": "hi", "dimensions": 16})
    assert "64" in refused(r, param="dimensions")
    r = httpx.post(qwen.url + "/v1/embeddings", json={"input": "hi", "dimensions": 64})  # its own size: fine
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


# --- an encoder: a tiny BERT -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("torch")
    from tests.torch.bert_helpers import save_tiny_bert

    d = tmp_path_factory.mktemp("bert")
    hf = save_tiny_bert(d, seed=2, pooling="mean")
    yield from torch_server(d, "tiny-bert", hf=hf)


def test_a_bert_encoder_embeds_as_transformers_does(bert):
    import torch
    import transformers

    from tests.torch.bert_helpers import hf_embedding

    texts = ["the cat sat on the mat.", "what is the capital of france?", "the cat sat on the mat."]
    r = bert.client().embeddings.create(model="tiny-bert", input=texts)
    vecs = [d.embedding for d in r.data]
    assert [len(v) for v in vecs] == [32, 32, 32] and vecs[0] == vecs[2] and vecs[0] != vecs[1]
    tok = transformers.AutoTokenizer.from_pretrained(bert.state.config.model.model)
    ids = [tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    for i, v in zip(ids, vecs):
        torch.testing.assert_close(torch.tensor(v), hf_embedding(bert.hf, i, "mean"), atol=2e-5, rtol=1e-4)


def test_an_encoder_answers_generation_routes_with_a_400_saying_so(bert):
    client = bert.client()
    import openai

    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.completions.create(model="tiny-bert", prompt="the cat", max_tokens=3)
    r = httpx.post(bert.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS
    long = httpx.post(bert.url + "/v1/embeddings", json={"input": "cat " * 200})  # past its 128 positions
    assert "128" in refused(long, param="input")


# --- the fake backend: the request's rules, and hostile bodies -----------------------------------------------------


@pytest.fixture(scope="module")
def fake():
    s = start_server(FAKE | {"model": {**FAKE["model"], "matryoshka": True},
                             "server": {"max_prompts_per_request": 64}})
    yield s
    s.stop()


def post(srv, body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=30)


def test_matryoshka_dimensions_cut_the_vector_then_normalize_it(fake):
    full = post(fake, {"input": "some text", "normalize": False}).json()["data"][0]["embedding"]
    short = post(fake, {"input": "some text", "dimensions": 8}).json()["data"][0]["embedding"]
    norm = math.sqrt(math.fsum(x * x for x in full[:8]))
    assert len(full) == 64 and len(short) == 8 and unit(short)
    assert all(math.isclose(a, b / norm, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(short, full[:8]))
    assert "between 1 and 64" in refused(post(fake, {"input": "x", "dimensions": 65}), param="dimensions")


def test_inputs_past_the_context_are_refused_unless_truncation_is_asked_for(fake):
    text = "y" * 600  # 600 byte tokens; the context holds 512
    assert "512" in refused(post(fake, {"input": ["ok", text]}), param="input[1]")
    r = post(fake, {"input": text, "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == 512
    assert post(fake, {"input": text, "truncate_prompt_tokens": 10}).json()["usage"]["prompt_tokens"] == 10
    refused(post(fake, {"input": text, "truncate_prompt_tokens": 513}), param="truncate_prompt_tokens")


def test_more_inputs_than_a_completions_body_takes_go_in_waves(fake):
    # LangChain's OpenAIEmbeddings sends up to 1000 texts a request (OpenAI takes 2048); this server takes 64
    # prompts a body, so the 300 go to the engine as five waves and come back whole, in order
    from langchain_openai import OpenAIEmbeddings

    texts = [f"document number {i}" for i in range(300)]
    emb = OpenAIEmbeddings(model="embedded", base_url=fake.url + "/v1", api_key="unused", check_embedding_ctx_length=False,
                           max_retries=0)
    docs = emb.embed_documents(texts)
    assert len(docs) == 300 and all(len(d) == 64 for d in docs)
    for i in (0, 63, 64, 299):  # each wave's edges: the vector of its own text
        assert docs[i] == post(fake, {"input": texts[i]}).json()["data"][0]["embedding"]
    assert fake.wait_idle(10)["cache"]["used_blocks"] == 0


BAD = [
    ({}, "input"), ({"input": None}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"),
    ({"input": [[]]}, "input"), ({"input": 7}, "input"), ({"input": [1.5]}, "input"), ({"input": [["a"]]}, "input"),
    ({"input": [[1, -1]]}, "input"), ({"input": [2**40]}, "input"), ({"input": ["a", ""]}, "input[1]"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"), ({"input": "x", "dimensions": 2**70}, "dimensions"),
    ({"input": "x", "user": 5}, "user"), ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "priority": 1}, "priority"), ({"input": ["x"] * 2049}, "input"), ({"input": "x", "model": "gpt"}, "model"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[json.dumps(b)[:40] for b, _ in BAD])
def test_bad_bodies_get_a_4xx_in_openais_shape(fake, body, param):
    r = post(fake, body)
    refused(r, 404 if param == "model" else 400, param)


def test_fuzzed_bodies_never_get_a_5xx_and_leave_nothing_held(fake):
    with httpx.Client(base_url=fake.url, timeout=60) as c:
        components = c.get("/openapi.json").json()["components"]["schemas"]
        valid = from_schema(components["EmbeddingRequest"], components)
        sent = []

        @settings(max_examples=150, deadline=None, database=None, derandomize=os.environ.get("CI") == "true",
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(valid, mutated(valid)))
        def one(body):
            r = c.post("/v1/embeddings", content=encode(body), headers={"content-type": "application/json"})
            sent.append(r.status_code)
            assert r.status_code < 500, (r.status_code, r.text[:300], repr(body)[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == ERROR_KEYS
            else:
                d = r.json()
                assert d["object"] == "list" and all(e["object"] == "embedding" for e in d["data"])

        one()
        assert {s for s in sent if s >= 400} and 200 in sent
    assert fake.wait_idle(10)["cache"]["used_blocks"] == 0


def test_server_embeddings_false_serves_no_route():
    s = start_server(FAKE | {"server": {"embeddings": False}})
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert "/v1/embeddings" not in httpx.get(s.url + "/openapi.json").json()["paths"]
    finally:
        s.stop()
