"""Constraints through the engine (fake backend, byte tokenizer, llguidance): every output follows its grammar.

Hypothesis draws JSON schemas and regexes the engine supports; whatever the (deterministic) fake
model picks among the allowed tokens, the finished output must validate / full-match. Schemas are
bounded (maxLength, maxItems, numeric bounds) so every output can end within max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.constraints import _set_bits, unpack_bitmask
from llmserve.engine import Engine
from llmserve.errors import InvalidRequestError
from llmserve.request import FinishReason, SamplingParams, StructuredOutput

_PROPS = settings(max_examples=200, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def eng():
    return Engine.from_config({"backend": {"name": "fake"}, "model": {"model": "embedded"},
                               "cache": {"num_blocks": 1024, "block_size": 16}})


def run(eng, spec: StructuredOutput, n: int = 1, max_tokens: int = 1500, prompt=(72, 105)) -> list[tuple[str, FinishReason]]:
    sp = SamplingParams(max_tokens=max_tokens, n=n, structured=spec)
    sp.validate()
    rid = eng.add_request(list(prompt), sp)
    toks: dict[int, list[int]] = {}
    ends = {}
    while eng.has_unfinished:
        for o in eng.step().outputs:
            assert o.request_id == rid
            toks.setdefault(o.index, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.index] = o.finish_reason
    return [(eng.tokenizer.decode(toks[i]), ends[i]) for i in range(n)]


# --- schemas ------------------------------------------------------------------------------------

_names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


def _leaf():
    string = st.builds(lambda m: {"type": "string", "maxLength": m}, st.integers(0, 6))
    pattern = st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"},
                               {"type": "string", "pattern": "^[0-9]{3}-[A-Z]{2}$"}])
    integer = st.tuples(st.integers(-1000, 1000), st.integers(0, 2000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    number = st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    enum = st.lists(st.one_of(st.integers(-5, 5), _names, st.booleans(), st.none()), min_size=1, max_size=4,
                    unique_by=lambda v: json.dumps(v)).map(lambda v: {"enum": v})
    return st.one_of(string, pattern, integer, number, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _extend(children):
    obj = st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))
    arr = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    return st.one_of(obj, arr)


schemas = st.recursive(_leaf(), _extend, max_leaves=6)


@_PROPS
@given(schema=schemas, n=st.integers(1, 3))
def test_every_output_validates_against_its_json_schema(eng, schema, n):
    for text, reason in run(eng, StructuredOutput("json", json.dumps(schema)), n=n):
        assert reason is FinishReason.STOP, (schema, text)
        jsonschema.validate(json.loads(text), schema)


# --- regexes ------------------------------------------------------------------------------------

_atom = st.one_of(st.sampled_from(["a", "b", "x", "-", "@", r"\.", "[a-c]", "[0-9]", "[A-Z]", "[^a-z\\n]", "é"]))


def _regex_extend(inner):
    rep = st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(lambda t: f"(?:{t[0]}){{{t[1]},{t[1] + t[2]}}}")
    alt = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")")
    seq = st.lists(inner, min_size=2, max_size=3).map("".join)
    return st.one_of(rep, alt, seq, inner.map(lambda x: f"(?:{x})?"))


regexes = st.recursive(_atom, _regex_extend, max_leaves=8)


@_PROPS
@given(regex=regexes)
def test_every_output_full_matches_its_regex(eng, regex):
    for text, reason in run(eng, StructuredOutput("regex", regex, "guided_regex"), n=2):
        assert reason is FinishReason.STOP
        assert re.fullmatch(regex, text), (regex, text)


# --- the rest of the behaviour ------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def each_engine(request):
    if request.param == "xgrammar":  # an optional extra (it pulls triton, ~1 GB): CI installs only llguidance
        pytest.importorskip("xgrammar")
    return Engine.from_config({"backend": {"name": "fake"}, "model": {"model": "embedded"},
                               "structured_output": {"name": request.param}})


def test_choice_regex_json_and_a_bad_schema_on_each_grammar_engine(each_engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "s": {"enum": ["x", "y"]}},
              "required": ["n", "s"], "additionalProperties": False}
    (text, reason), = run(each_engine, StructuredOutput("json", json.dumps(schema)))
    assert reason is FinishReason.STOP
    jsonschema.validate(json.loads(text), schema)
    (text, _), = run(each_engine, StructuredOutput("regex", "[a-c]{2}-[0-9]"))
    assert re.fullmatch("[a-c]{2}-[0-9]", text)
    (text, _), = run(each_engine, StructuredOutput("choice", json.dumps(["one", "two words"])))
    assert text in ("one", "two words")
    with pytest.raises(InvalidRequestError) as e:
        each_engine.add_request([1], SamplingParams(structured=StructuredOutput("json", '{"type": 5}', "guided_json")))
    assert e.value.param == "guided_json"


def test_choice_grammar_and_json_object(eng):
    (text, _), = run(eng, StructuredOutput("choice", json.dumps(["left", "right", "up"])))
    assert text in ("left", "right", "up")
    (text, _), = run(eng, StructuredOutput("grammar", 'start: "x=" /[0-9]{2}/ ";"'))
    assert re.fullmatch(r"x=[0-9]{2};", text)
    (text, reason), = run(eng, StructuredOutput("json_object"), max_tokens=4000)
    assert reason is FinishReason.STOP and isinstance(json.loads(text), dict)


def test_a_cut_output_ends_with_length_and_is_a_prefix_of_the_grammar(eng):
    (text, reason), = run(eng, StructuredOutput("regex", "[a-z]{50}"), max_tokens=5)
    assert reason is FinishReason.LENGTH and re.fullmatch("[a-z]{5}", text)


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput("json", '{"type": 5}', "response_format.json_schema.schema"), "type"),
    (StructuredOutput("json", "{not json", "guided_json"), "not valid JSON"),
    (StructuredOutput("regex", "([a-", "guided_regex"), "regex"),
    (StructuredOutput("grammar", "start: missing_rule", "structured_outputs.grammar"), "missing_rule"),
])
def test_a_bad_grammar_is_refused_naming_its_field(eng, spec, words):
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1, 2], SamplingParams(structured=spec))
    assert e.value.param == spec.param and words in str(e.value)
    assert not eng.has_unfinished  # nothing was queued


def test_allowed_token_ids_and_bad_words_share_the_mask(eng):
    sp = SamplingParams(max_tokens=30, allowed_token_ids=[ord("a"), ord("b")],
                        bad_words_token_ids=[[ord("a"), ord("a")], [ord("b"), ord("b")]])
    out = eng.tokenizer.decode(eng.generate([[1, 2, 3]], sp)[0])
    assert out == "ab" * 15 or out == "ba" * 15  # only a and b, never twice in a row
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([1], SamplingParams(allowed_token_ids=[5, 10**6]))
    assert e.value.param == "allowed_token_ids"


def test_only_constrained_rows_carry_a_mask(eng):
    seen = []
    execute = eng.backend.execute
    eng.backend.execute = lambda batch: seen.append((batch.token_bitmask, list(batch.bitmask_rows))) or execute(batch)
    try:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
        assert seen and all(mask is None for mask, _ in seen)  # unconstrained: nothing to pay
        seen.clear()
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=3))
        eng.add_request([4, 5, 6], SamplingParams(max_tokens=3, structured=StructuredOutput("regex", "[a-z]{3}")))
        while eng.has_unfinished:
            eng.step()
        assert any(mask is not None and mask.shape == (1, 9) and len(rows) == 1 for mask, rows in seen)
    finally:
        eng.backend.execute = execute


def test_a_faulty_neighbour_leaves_constrained_sequences_their_masks(eng):
    from tests.core.test_engine import fail_on_seed

    fail_on_seed(eng, 666)
    bad = eng.add_request([7, 8, 9], SamplingParams(max_tokens=5, seed=666))
    ok = [eng.add_request([4, 5, i], SamplingParams(max_tokens=50, structured=StructuredOutput("regex", "[a-z]{3}x")))
          for i in range(3)]
    text: dict[str, list[int]] = {}
    ends = {}
    while eng.has_unfinished:
        for o in eng.step().outputs:
            text.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.request_id] = o.finish_reason
    assert ends[bad] is FinishReason.ERROR
    for rid in ok:  # split off from the faulty row, each kept its own mask row
        assert ends[rid] is FinishReason.STOP and re.fullmatch("[a-z]{3}x", eng.tokenizer.decode(text[rid]))


def test_bitmask_packing_round_trips():
    row = torch.zeros(9, dtype=torch.int32)
    ids = [0, 31, 32, 63, 255, 256]
    _set_bits(row, ids, True)
    assert unpack_bitmask(row.unsqueeze(0), 257)[0].nonzero().flatten().tolist() == ids
    _set_bits(row, [31, 256], False)
    assert unpack_bitmask(row.unsqueeze(0), 257)[0].nonzero().flatten().tolist() == [0, 32, 63, 255]


def test_hook_register_structured_output():
    """A third-party grammar engine, registered through register_structured_output and picked by name."""
    from llmserve.hookspecs import hookimpl
    from llmserve.interfaces import GrammarEngine, GrammarMatcher

    class Digits(GrammarMatcher):
        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0
            _set_bits(bitmask[row], list(range(48, 58)), True)

        def accept(self, token_id):
            return 48 <= token_id < 58

        def is_terminated(self):
            return False

    class DigitsOnly(GrammarEngine):
        def compile(self, spec):
            if spec.value != "[0-9]*":
                raise InvalidRequestError("only [0-9]*", param=spec.param)
            return spec.value

        def matcher(self, compiled):
            return Digits()

    class Plugin:
        __name__ = "digits-plugin"

        @hookimpl
        def register_structured_output(self, register):
            register("digits", lambda config, tokenizer, vocab_size: DigitsOnly())

    e = Engine.from_config({"backend": {"name": "fake"}, "model": {"model": "embedded"},
                            "structured_output": {"name": "digits"}}, extra_plugins=[Plugin()])
    out = e.generate([[1, 2]], SamplingParams(max_tokens=20, structured=StructuredOutput("regex", "[0-9]*")))[0]
    assert len(out) == 20 and all(48 <= t < 58 for t in out)
    with pytest.raises(InvalidRequestError, match="only"):
        e.add_request([1], SamplingParams(structured=StructuredOutput("regex", "x")))


def test_a_grammar_that_breaks_mid_stream_fails_its_sequence_alone(eng):
    """A matcher that cannot give a mask (an engine limit) fails its request; the others in the batch go on."""
    class Breaks:
        calls = 0

        def fill_bitmask(self, bitmask, row):
            Breaks.calls += 1
            if Breaks.calls > 2:
                raise ValueError("row limit reached")
            bitmask[row] = -1

        def accept(self, token_id):
            return True

        def is_terminated(self):
            return False

    spec = StructuredOutput("regex", "x*")
    engine_matcher = eng.constraints._engine.matcher  # noqa: SLF001
    eng.constraints._engine.matcher = lambda compiled: Breaks()  # noqa: SLF001
    try:
        bad = eng.add_request([1, 2], SamplingParams(max_tokens=10, structured=spec))
    finally:
        eng.constraints._engine.matcher = engine_matcher  # noqa: SLF001
    good = eng.add_request([1, 2], SamplingParams(max_tokens=10))
    ends = {}
    while eng.has_unfinished:
        for o in eng.step().outputs:
            if o.finished:
                ends[o.request_id] = o
    assert ends[bad].finish_reason is FinishReason.ERROR and "row limit reached" in ends[bad].error
    assert ends[good].finish_reason is FinishReason.LENGTH and ends[good].num_output_tokens == 10


def test_a_process_that_exits_while_the_vocabulary_builds_exits_cleanly(tmp_path):
    # llguidance's view of a vocabulary builds in a thread (~1 s for Qwen2.5's); a process ending meanwhile (a script,
    # a start-up that failed) segfaulted when that thread, a daemon then, came back from llguidance to a finalizing
    # interpreter
    import os
    import subprocess
    import sys

    code = ("from llmserve.interfaces import Tokenizer\n"
            "from llmserve_grammar.llg import LLGuidanceEngine\n"
            "class Big(Tokenizer):\n"
            "    eos_token_id, vocab_size = 0, 300_000\n"
            "    def encode(self, text, add_special_tokens=True): return list(text.encode())\n"
            "    def decode(self, ids, skip_special_tokens=True): return ''\n"
            "    def vocab_bytes(self): return [b'<eos>'] + [b'%x ' % i for i in range(1, self.vocab_size)]\n"
            "import time; LLGuidanceEngine(Big(), Big.vocab_size); time.sleep(0.05)\n")  # exits mid-build
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "plugins")])}
    for _ in range(4):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12),
       out=st.lists(st.integers(0, 5), max_size=8))
def test_bad_words_ban_what_the_rule_says(words, out):
    """The indexed bad words ban what vLLM's rule does: the last token of each word whose others end the output."""
    from types import SimpleNamespace

    from llmserve.constraints import _BadWords

    r = SimpleNamespace(token_ids=[9, 9] + out, num_prompt_tokens=2)
    rule = {w[-1] for w in words if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])}
    assert set(_BadWords(words).banned(r)) == rule
