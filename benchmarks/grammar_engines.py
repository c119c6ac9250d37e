#!/usr/bin/env python
"""llguidance vs xgrammar, as our engine calls them: mask time per step at batch 64, compile time, schema coverage.

The vocabulary has Qwen2's size (151,936): SmolLM2's 49,152 real tokens (the default model's
tokenizer), 20,000 CJK characters (Qwen2's vocabulary holds many), then real tokens extended by a
short real token, the way BPE merges grow words. `--vocab real` measures the 49,152 alone.
Each of the 64 sequences walks a valid JSON document of its schema token by token (teacher
forcing); every step times fill_bitmask over the 64 rows (what Constraints.fill does before each
forward) and accept. Coverage: a list of JSON-schema features, each compiled and walked with a
valid instance.

    python benchmarks/grammar_engines.py [--batch 64] [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

import torch  # noqa: E402

from llmserve_bench.report import machine_info  # noqa: E402
from llmserve.interfaces import Tokenizer  # noqa: E402
from llmserve.request import StructuredOutput  # noqa: E402

VOCAB = 151_936

SCHEMA = {  # an extraction schema of the kind agents send
    "type": "object", "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "address": {"type": "object", "additionalProperties": False,
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "scores", "address", "active"],
}

# feature → (schema, a valid instance[, an instance only the feature makes invalid: an engine that
# ignores the keyword accepts it])
FEATURES = {
    "type/properties/required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}}, {"x": 2}),
    "enum": ({"enum": ["a", 1, None]}, 1),
    "const": ({"const": "fixed"}, "fixed"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "s"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                         {"required": ["a"]}]}, {"a": 3}),
    "$ref/$defs": ({"$defs": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/p"}}, [1, 2]),
    "recursive $ref": ({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                        "$ref": "#/$defs/n"}, {"c": [{"c": []}]}),
    "string minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc"),
    "string pattern": ({"type": "string", "pattern": "^[A-Z][a-z]+$"}, "Paris"),
    "format date-time": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z"),
    "format email": ({"type": "string", "format": "email"}, "a@b.co"),
    "format uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000"),
    "integer minimum/maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, 1),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "number bounds": ({"type": "number", "minimum": -1.5, "maximum": 2.5}, 0.25),
    "array minItems/maxItems": ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, [True]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, [1, "a"]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "type list": ({"type": ["integer", "null"]}, None),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"x1": 1}, {"x1": "s"}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"AB": 1}),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "if/then/else": ({"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 3, -1),
    "not": ({"not": {"type": "string"}}, 1, "s"),
    "dependentRequired": ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
                          {"a": 1, "b": 2}, {"a": 1}),
}


class SyntheticVocab(Tokenizer):
    """A 151,936-entry vocabulary: the real tokenizer's tokens, then concatenations of pairs of them."""

    def __init__(self, real: Tokenizer, size: int = VOCAB, seed: int = 0):
        self.real = real
        base = real.vocab_bytes()
        specials = real.all_special_ids
        words = [b for i, b in enumerate(base) if i not in specials and b]
        short = [w for w in words if len(w) <= 3]
        rng = random.Random(seed)
        seen = set(base)
        extra = [chr(0x4E00 + i).encode() for i in range(20_000)]
        seen.update(extra)
        while len(base) + len(extra) < size:
            t = rng.choice(words) + rng.choice(short)
            if t not in seen:
                seen.add(t)
                extra.append(t)
        self._vocab = base + extra
        self.vocab_size = size
        self.eos_token_id = real.eos_token_id

    def vocab_bytes(self) -> list[bytes]:
        return self._vocab

    def encode(self, text, add_special_tokens=True):
        return self.real.encode(text, add_special_tokens)

    def decode(self, token_ids, skip_special_tokens=True):
        return self.real.decode([t for t in token_ids if t < len(self.real.vocab_bytes())], skip_special_tokens)

    @property
    def all_special_ids(self):
        return self.real.all_special_ids


def real_tokenizer() -> Tokenizer:
    """The default model's tokenizer, from the GGUF `make model` fetched (its converted copy is cached)."""
    from llmserve_tokenizers.hf import HFTokenizer
    from llmserve_torch.gguf_cache import cached_metadata
    from llmserve_torch.packaged import DEFAULT_MODEL, resolve

    directory, _ = cached_metadata(resolve(DEFAULT_MODEL))
    return HFTokenizer.load(str(directory))


def build_engine(name: str, tok: Tokenizer):
    if name == "llguidance":
        from llmserve_grammar.llg import LLGuidanceEngine

        return LLGuidanceEngine(tok, VOCAB)
    from llmserve_grammar.xgr import XGrammarEngine

    return XGrammarEngine(tok, VOCAB)


def instance(rng: random.Random) -> dict:
    """A random valid document of SCHEMA."""
    name = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 30)))
    return {"name": name, "age": rng.randint(0, 150), "email": f"user{rng.randint(1, 999)}@mail.com",
            "role": rng.choice(["admin", "user", "guest"]),
            "scores": [round(rng.uniform(0, 100), 2) for _ in range(rng.randint(0, 8))],
            "address": {"city": rng.choice(["Paris", "Lyon", "Zurich"]), "zip": f"{rng.randint(0, 99999):05d}"},
            "active": rng.random() < 0.5}


def walk(engine, spec: StructuredOutput, docs: list[str], tok: Tokenizer, steps: int) -> dict:
    """Teacher-force len(docs) sequences through their matchers; time the batch's mask and accepts per step."""
    t0 = time.perf_counter()
    compiled = engine.compile(spec)
    compile_s = time.perf_counter() - t0
    ms = [engine.matcher(compiled) for _ in docs]
    toks = [tok.encode(d, add_special_tokens=False) + [tok.eos_token_id] for d in docs]
    mask = torch.empty((len(docs), (VOCAB + 31) // 32), dtype=torch.int32)
    fill_s, accept_s, rejected, n_steps = [], [], 0, 0
    for step in range(steps):
        live = [k for k in range(len(docs)) if step < len(toks[k])]
        if not live:
            break
        t0 = time.perf_counter()
        for k in live:  # as Constraints.fill calls them, one row at a time on the engine thread
            ms[k].fill_bitmask(mask, k)
        t1 = time.perf_counter()
        for k in live:
            t = toks[k][step]
            allowed = (int(mask[k, t // 32]) >> (t % 32)) & 1
            rejected += (not allowed) or (not ms[k].accept(t))
        t2 = time.perf_counter()
        fill_s.append((t1 - t0) / len(live))
        accept_s.append((t2 - t1) / len(live))
        n_steps += 1
    return {"compile_ms": compile_s * 1e3, "steps": n_steps, "rejected_tokens": rejected,
            "mask_us_per_token": statistics.mean(fill_s) * 1e6,
            "mask_us_per_token_p99": sorted(fill_s)[int(0.99 * (len(fill_s) - 1))] * 1e6,
            "mask_ms_per_step_batch": statistics.mean(fill_s) * len(docs) * 1e3,
            "accept_us_per_token": statistics.mean(accept_s) * 1e6}


def coverage(engine, tok: Tokenizer) -> dict[str, str]:
    """feature → ok | why not (compile refused, a valid instance rejected, an invalid one accepted)."""
    out = {}
    for feature, (schema, inst, *invalid) in FEATURES.items():
        spec = StructuredOutput("json", json.dumps(schema))
        try:
            r = walk(engine, spec, [json.dumps(inst, separators=(",", ":"))], tok, 10_000)
            bad = invalid and walk(engine, spec, [json.dumps(invalid[0], separators=(",", ":"))], tok, 10_000)
            out[feature] = ("rejects a valid instance" if r["rejected_tokens"] else
                            "accepts an invalid instance (ignores the keyword)" if bad and not bad["rejected_tokens"]
                            else "ok")
        except Exception as e:  # noqa: BLE001 - the engine's refusal is the datum
            out[feature] = f"refused: {str(e).splitlines()[0][:90]}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", choices=["synthetic", "real"], default="synthetic",
                    help="Qwen2-sized synthetic vocabulary (default), or the real 49,152-token one alone")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    global VOCAB
    real = real_tokenizer()
    tok = SyntheticVocab(real, seed=args.seed) if args.vocab == "synthetic" else real
    VOCAB = tok.vocab_size
    rng = random.Random(args.seed)
    docs = [json.dumps(instance(rng), separators=(",", ":")) for _ in range(args.batch)]
    report = {"machine": machine_info(), "vocab_size": VOCAB, "batch": args.batch, "engines": {}}
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        engine = build_engine(name, tok)
        build_s = time.perf_counter() - t0
        r = walk(engine, StructuredOutput("json", json.dumps(SCHEMA)), docs, tok, args.steps)
        r_warm = walk(engine, StructuredOutput("json", json.dumps(SCHEMA)), docs, tok, args.steps)  # cached compile
        cov = coverage(engine, tok)
        report["engines"][name] = {"tokenizer_build_s": build_s, "cold": r, "warm": r_warm,
                                   "coverage": cov, "coverage_ok": sum(v == "ok" for v in cov.values()),
                                   "coverage_total": len(cov)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"vocab {VOCAB}, batch {args.batch}, {report['machine']['cpu']}")
    cols = ["tokenizer build s", "compile ms", "mask µs/token", "mask p99 µs", "mask ms/step@batch", "accept µs/token",
            "coverage"]
    print(f"{'engine':12}" + "".join(f"{c:>20}" for c in cols))
    for name, e in report["engines"].items():
        w = e["warm"]
        vals = [f"{e['tokenizer_build_s']:.2f}", f"{e['cold']['compile_ms']:.1f}", f"{w['mask_us_per_token']:.1f}",
                f"{w['mask_us_per_token_p99']:.1f}", f"{w['mask_ms_per_step_batch']:.2f}",
                f"{w['accept_us_per_token']:.1f}", f"{e['coverage_ok']}/{e['coverage_total']}"]
        print(f"{name:12}" + "".join(f"{v:>20}" for v in vals))
        if e["cold"]["rejected_tokens"]:
            print(f"  {name}: rejected {e['cold']['rejected_tokens']} tokens of valid documents")
    print("coverage (feature: " + " / ".join(report["engines"]) + ")")
    for feature in FEATURES:
        print(f"  {feature:30} " + " | ".join(report["engines"][n]["coverage"][feature] for n in report["engines"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
