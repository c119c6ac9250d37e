"""Request parsing cost and error quality: the hand-written parser of a baseline revision vs the pydantic models.

Each body goes from raw bytes to validated SamplingParams, as a request does on the server (the
baseline's parse_json + parse_* + SamplingParams.validate; today's protocol.parse). Prints µs per
request for each, then the `param` and message each gives for bad bodies.

    python benchmarks/request_parsing.py [--baseline REV] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmserve.server.errors import ApiError  # noqa: E402
from llmserve.server.protocol import ChatRequest, CompletionRequest, parse  # noqa: E402

# the last revision whose server/protocol.py was the hand-written `Fields` parser
BASELINE = "dd457d6"

_CHAT_TURNS = [{"role": "user" if i % 2 == 0 else "assistant",
                "content": f"turn {i}: " + "a fairly ordinary sentence of chat text, " * 5} for i in range(49)]

GOOD = {
    "completion small": ("completion", {"model": "m", "prompt": "Hello, my name is", "max_tokens": 16,
                                        "temperature": 0.7}),
    "completion logprobs/stop/logit_bias": ("completion", {
        "model": "m", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.8, "top_p": 0.95,
        "logprobs": 5, "echo": True, "stop": ["\n\n", "The end", "###"], "seed": 7, "n": 2,
        "logit_bias": {str(t): (-1) ** t * t / 10 for t in range(20)}, "stream": True,
        "stream_options": {"include_usage": True}, "top_k": 40, "min_p": 0.05, "stop_token_ids": [2, 3],
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "user": "u-1"}),
    "completion 1024 token ids": ("completion", {"prompt": list(range(1024)), "max_tokens": 128,
                                                 "ignore_eos": True}),
    "chat small": ("chat", {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi!"}], "max_tokens": 32}),
    "chat 50 messages": ("chat", {"model": "m", "max_completion_tokens": 256, "temperature": 0.2,
                                  "logprobs": True, "top_logprobs": 3, "stop": ["<|end|>"],
                                  "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
                                  + _CHAT_TURNS}),
}

BAD = {
    "temperature a string": ("completion", {"prompt": "x", "temperature": "hot"}),
    "temperature out of range": ("completion", {"prompt": "x", "temperature": 2.5}),
    "max_tokens true": ("completion", {"prompt": "x", "max_tokens": True}),
    "prompt mixes ids and text": ("completion", {"prompt": [[1, 2], "x"]}),
    "logit_bias value out of range": ("completion", {"prompt": "x", "logit_bias": {"5": 101}}),
    "stream_options without stream": ("completion", {"prompt": "x", "stream_options": {"include_usage": True}}),
    "missing prompt": ("completion", {"max_tokens": 3}),
    "image part in messages[2]": ("chat", {"messages": [{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": "b"},
                                                        {"role": "user", "content": [
                                                            {"type": "image_url", "image_url": {"url": "x"}}]}]}),
    "messages[1].role unknown": ("chat", {"messages": [{"role": "user", "content": "a"},
                                                       {"role": "robot", "content": "b"}]}),
    "messages[1].content[0].text a number": ("chat", {"messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    "response_format json_object": ("chat", {"messages": [{"role": "user", "content": "a"}],
                                             "response_format": {"type": "json_object"}}),
    "not JSON": ("chat", b"{\"messages\": ["),
}


def load_baseline(rev: str) -> types.ModuleType:
    """server/protocol.py as it was at rev, imported under another name."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:llmserve/server/protocol.py"],
                         check=True, capture_output=True, text=True).stdout
    mod = sys.modules["baseline_protocol"] = types.ModuleType("baseline_protocol")  # dataclasses look it up
    exec(compile(src, f"{rev}:llmserve/server/protocol.py", "exec"), mod.__dict__)
    return mod


def parsers(old: types.ModuleType) -> dict:
    """endpoint -> (baseline parse, today's parse), each from raw bytes to validated SamplingParams."""
    def old_parse(fn):
        def run(raw: bytes):
            req = fn(old.parse_json(raw))
            req.common.sampling.validate()  # the baseline's route validated once more before submitting
            return req
        return run

    return {"completion": (old_parse(old.parse_completion), lambda raw: parse(CompletionRequest, raw, "bench")),
            "chat": (old_parse(old.parse_chat), lambda raw: parse(ChatRequest, raw, "bench"))}


def per_request_us(fn, raw: bytes) -> float:
    """The best of 5 repeats of about 0.2 s each, in µs per call."""
    t = timeit.Timer(lambda: fn(raw))
    n, _ = t.autorange()
    n = max(1, n)
    return min(t.repeat(5, n)) / n * 1e6


def outcome(fn, raw: bytes) -> dict:
    try:
        fn(raw)
    except ApiError as e:
        return {"status": e.status, "param": e.param, "code": e.code, "message": e.message}
    except Exception as e:  # what the server would have answered with a 500
        return {"status": 500, "param": None, "code": None, "message": f"{type(e).__name__}: {e}"}
    return {"status": 200}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision with the hand-written parser")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args()
    ps = parsers(load_baseline(args.baseline))

    def raw(body) -> bytes:
        return body if isinstance(body, bytes) else json.dumps(body).encode()

    timing = {}
    for name, (ep, body) in GOOD.items():
        old, new = ps[ep]
        timing[name] = {"bytes": len(raw(body)), "baseline_us": round(per_request_us(old, raw(body)), 2),
                        "pydantic_us": round(per_request_us(new, raw(body)), 2)}
    errors = {name: {"baseline": outcome(ps[ep][0], raw(body)), "pydantic": outcome(ps[ep][1], raw(body))}
              for name, (ep, body) in BAD.items()}
    if args.json:
        print(json.dumps({"baseline": args.baseline, "python": sys.version.split()[0], "timing": timing,
                          "errors": errors}, indent=1))
        return
    print(f"µs per request, raw bytes to validated SamplingParams (baseline {args.baseline}; best of 5)")
    print(f"{'body':40} {'bytes':>6} {'Fields':>8} {'pydantic':>9} {'ratio':>6}")
    for name, t in timing.items():
        print(f"{name:40} {t['bytes']:6d} {t['baseline_us']:8.1f} {t['pydantic_us']:9.1f} "
              f"{t['pydantic_us'] / t['baseline_us']:6.2f}")
    print("\nbad bodies: status, param, message")
    for name, r in errors.items():
        print(f"- {name}")
        for who in ("baseline", "pydantic"):
            o = r[who]
            print(f"    {who:9} {o['status']} param={o.get('param')!r} {o.get('message', '')}")


if __name__ == "__main__":
    main()
