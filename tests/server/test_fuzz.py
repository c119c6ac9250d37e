"""The hostile-input fuzzer: thousands of bodies, built from the server's own /openapi.json and then broken.

Each body is drawn from the published request schema (a small schema walker below: fast, and
biased to values a server accepts, so that real generations and streams run too), then often
mutated at any depth: huge and many-digit integers, non-finite and out-of-range numbers,
deep nesting, lone surrogates, wrong types, giant strings and lists, unknown fields. Every
response must be < 500; a refusal must be OpenAI's error object; a stream must be well-formed
and end with [DONE]. Afterwards the server is healthy and holds no KV block.
"""

from __future__ import annotations

import copy
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import FAKE, start_server

ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest",
             "/v1/generate": "GenerateRequest"}
EXAMPLES = 1000  # per endpoint: 3,000 bodies a run
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def srv():
    s = start_server(FAKE | {"server": {"max_sequences_per_request": 16, "request_timeout": 20}})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


class Raw:
    """JSON text sent as is where this stands in a body (what json.dumps cannot write)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r})"


def encode(body) -> bytes:
    raws: list[Raw] = []

    def placeholder(o):
        raws.append(o)
        return f"@@raw{len(raws) - 1}@@"

    text = json.dumps(body, default=placeholder)
    for i, r in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', r.text, 1)
    return text.encode("utf-8", "surrogatepass")


HOSTILE = st.one_of(
    st.sampled_from([Raw("1" * 4301), Raw("-" + "9" * 5000), Raw("1e400"), Raw("-1e400"), Raw("NaN"),
                     Raw("Infinity"), Raw("1" * 310 + ".5"), Raw("[" * 3000 + "]" * 3000),
                     Raw('{"a":' * 3000 + "1" + "}" * 3000), Raw("1E-400"), Raw("-0")]),
    st.sampled_from([2**63, -(2**63) - 1, 2**31, 2**64 + 1, -1, 0, 1.5, -0.0, 1e308, True, False, None,
                     "", "\ud800", "ab\udfffcd", "\x00", "a" * 100_000, [], {}, [[]], [None], {"": None},
                     [0] * 20_000, ["x"] * 600, [[1, 2]] * 600, {"type": "json_schema"},
                     {"role": ["user"], "content": {"a": 1}}]),
    # no subnormals: a library in the suite sets flush-to-zero for the whole process
    st.integers(), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), st.text(max_size=30),
    st.lists(st.integers(-(2**40), 2**40), max_size=5),
)


@st.composite
def mutated(draw, base):
    """base with one to three values replaced at any depth (or a key added) by something hostile."""
    body = copy.deepcopy(draw(base))  # strategies may hand out shared objects: never mutate those
    for _ in range(draw(st.integers(1, 3))):
        paths = []

        def walk(node, path):
            paths.append(path)
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, path + [k])
            elif isinstance(node, list):
                for i, v in enumerate(node[:20]):
                    walk(v, path + [i])

        walk(body, [])
        path = draw(st.sampled_from(paths))
        value = copy.deepcopy(draw(HOSTILE))
        if not path:
            body = value if draw(st.booleans()) else {draw(st.text(max_size=12)): value, **(body or {})} \
                if isinstance(body, dict) else value
            continue
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent[draw(st.sampled_from(["stream", "n", "max_tokens", "messages", "prompt", "logprobs",
                                         "response_format", "tools", "stop", "seed", "extra"]))] = value
        else:
            parent[path[-1]] = value
    return body


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values shaped like a JSON schema (the subset pydantic writes): objects draw a subset of their properties."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth + 1))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "object":
        props = {k: from_schema(v, components, depth + 1) for k, v in schema.get("properties", {}).items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        if depth > 4 or not props:
            return st.fixed_dictionaries(required) if required else st.builds(dict)
        # a few fields at a time, so that most unmutated bodies are accepted and really run
        return st.lists(st.sampled_from(sorted(props)), max_size=4, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({**required, **{k: props[k] for k in keys}}))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), min_size=schema.get("minItems", 1),
                        max_size=3)
    return {
        "string": st.text(min_size=schema.get("minLength", 0), max_size=12),
        "integer": st.one_of(st.integers(0, 8), st.integers()),
        "number": st.one_of(st.floats(0, 2, allow_subnormal=False), st.floats(allow_subnormal=False)),
        "boolean": st.booleans(),
        "null": st.none(),
    }.get(kind, st.one_of(st.none(), st.integers(0, 8), st.text(max_size=8)))


def bodies(endpoint: str):
    components = _COMPONENTS
    valid = from_schema(components[ENDPOINTS[endpoint]], components)
    return st.one_of(valid, mutated(valid), mutated(valid))


_COMPONENTS: dict = {}


def check(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300], repr(body)[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str), r.text[:300]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for e in events[:-1]:
            payload = json.loads(e)
            assert "error" not in payload or payload["error"]["type"] != "server_error", (e, repr(body)[:500])
    else:
        d = r.json()
        assert "choices" in d or "token_ids" in d, r.text[:300]  # OpenAI's shape, or /v1/generate's


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_fuzzed_bodies_never_get_a_5xx(srv, client, endpoint):
    _COMPONENTS.update(client.get("/openapi.json").json()["components"]["schemas"])
    sent = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=os.environ.get("CI") == "true",
              suppress_health_check=list(HealthCheck))
    @given(bodies(endpoint))
    def one(body):
        r = client.post(endpoint, content=encode(body), headers={"content-type": "application/json"})
        sent.append(r.status_code)
        check(r, body)

    one()
    assert len(sent) >= EXAMPLES
    assert {s for s in sent if s >= 400} and 200 in sent  # both refusals and real answers were exercised
    assert client.get("/health").status_code == 200
    idle = srv.wait_idle(10)
    assert idle["cache"]["used_blocks"] == 0 and idle["server"]["active_requests"] == 0
