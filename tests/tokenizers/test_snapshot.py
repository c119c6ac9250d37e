"""The tokenizer snapshot of a GGUF's cache: written by the load that uses transformers, read by later starts without
it, and equal to transformers in ids, text, bytes and rendered chat prompts (llama/SmolLM2- and Qwen2-like files)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.config import config_from_dict
from llmserve.errors import InvalidRequestError
from llmserve.plugins import load_plugins
from llmserve_tokenizers import snapshot
from llmserve_tokenizers.hf import HFTokenizer, _loader
from llmserve_tokenizers.snapshot import SnapshotTokenizer
from tests.server.tool_helpers import QWEN_TEMPLATE, TIME, WEATHER
from tests.torch.gguf_helpers import SPECIALS, VOCAB, make_decoder, write_gguf

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("llama", "qwen2")  # SmolLM2's shape (the generic fast class) and Qwen2.5's (Qwen2Tokenizer)

# a template using what transformers' sandbox adds: namespace, loop controls, dict(), {% generation %}, the special
# tokens it passes, tojson's options, a kwarg, reasoning_content and raise_exception
RICH_TEMPLATE = r"""
{%- set ns = namespace(n=0) -%}
{{- bos_token -}}
{%- for m in messages -%}
  {%- if m.role == 'developer' %}{{ raise_exception('no developer messages') }}{% endif -%}
  {%- if loop.index > 8 %}{% break %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {%- set d = dict(role=m.role, i=loop.index0) -%}
  <|im_start|>{{ d.role }}{{ d.i }}
  {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
  {%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2, sort_keys=True) }}{% endif %}
  {%- if m.name is defined %} ({{ m.name }}){% endif -%}
  <|im_end|>
{% endfor -%}
{%- if tools %}[{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]{% endif -%}
{{ ns.n }} {{ eos_token }} {{ unk_token }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif -%}
"""

CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "Be brief <|im_end|> é"}, {"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "content": "-3 C", "tool_call_id": "c1", "name": "get_weather"},
     {"role": "assistant", "content": "It is cold.  ", "reasoning_content": "cold"}],
    [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "Once upon a"}],
]


def _build(model: str) -> object:
    """The "hf" tokenizer through the plugin registry, as the engine builds it."""
    ps = load_plugins(defaults=("llmserve_tokenizers",), entry_points=False)
    return ps.get("tokenizer", "hf").factory(config_from_dict({"model": {"model": model}}))


def _transformers(d: Path, template: str | None = None) -> HFTokenizer:
    """The tokenizer as hf.py builds it with transformers, whatever the directory holds."""
    return HFTokenizer(_loader(str(d)).from_pretrained(str(d)), str(d), template)


def _cache_copy(src: Path, dst: Path) -> Path:
    """A copy of a GGUF cache entry without its snapshot: a cache an older version wrote."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(snapshot.FILE))
    return dst


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """arch → (the GGUF file, the cache root, its cache entry as a first start writes it)."""
    from llmserve_torch import gguf_cache

    out = {}
    for arch in ARCHS:
        root = tmp_path_factory.mktemp(f"cache-{arch}")
        path = write_gguf(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", make_decoder(arch, hidden=32))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LLMSERVE_CACHE", str(root))
            entry, has_tokenizer = gguf_cache.cached_metadata(path)
        assert has_tokenizer
        out[arch] = path, root, entry
    return out


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, caches, tmp_path_factory):
    """(transformers' tokenizer, the snapshot's) of one arch's cache as an older version left it, without a snapshot:
    the first load writes it, the second reads it."""
    entry = _cache_copy(caches[request.param][2], tmp_path_factory.mktemp("old") / "entry")
    first = _build(str(entry))
    assert isinstance(first, HFTokenizer) and snapshot.path(entry).is_file()
    second = _build(str(entry))
    assert isinstance(second, SnapshotTokenizer)
    return first, second


def test_the_qwen2_cache_names_qwen2tokenizer(caches):
    """The two shapes differ where it matters: AutoTokenizer's registry (Qwen2) and the generic class (SmolLM2)."""
    named = {a: json.loads((caches[a][2] / "tokenizer_config.json").read_text())["tokenizer_class"] for a in ARCHS}
    assert named["qwen2"] == "Qwen2Tokenizer" and named["llama"] != "Qwen2Tokenizer"


@pytest.mark.parametrize("arch", ARCHS)
def test_a_first_start_writes_the_snapshot_a_transformers_load_writes(caches, tmp_path, arch):
    """The GGUF cache's first start writes it (so even that start's tokenizer skips transformers' load), of the
    tokenizer the "hf" tokenizer serves from those files (for Qwen2 not the one built from the metadata)."""
    entry = caches[arch][2]
    old = _cache_copy(entry, tmp_path / "old")
    assert isinstance(_build(str(old)), HFTokenizer)
    assert json.loads(snapshot.path(old).read_text()) == json.loads(snapshot.path(entry).read_text())


def test_the_snapshot_holds_what_transformers_computes(pair):
    hf, snap = pair
    assert snap.eos_token_id == hf.eos_token_id == 2
    assert snap.vocab_size == hf.vocab_size == VOCAB
    assert snap.all_special_ids == hf.all_special_ids and 2 in snap.all_special_ids
    assert snap.chat_template == hf.chat_template and "<|im_start|>" in snap.chat_template
    assert snap.vocab_bytes() == hf.vocab_bytes()
    assert [snap.token_bytes(i) for i in range(VOCAB)] == [hf.token_bytes(i) for i in range(VOCAB)]


def test_vocab_bytes_are_each_tokens_bytes(pair):
    """The ids of a text, mapped through vocab_bytes, give the text's UTF-8 bytes back (what a grammar engine needs)."""
    _, snap = pair
    vb = snap.vocab_bytes()
    for text in ("hello world", "héllo\n\n wörld ✓ 🙂", "  \t x"):
        assert b"".join(vb[i] for i in snap.encode(text, add_special_tokens=False)) == text.encode()
    assert vb[1] == b"<|im_start|>"


def test_a_long_text_gets_the_same_ids_and_leaves_the_gil_to_others(pair):
    """Past 16k characters the snapshot encodes with encode_batch, which lets the event loop's thread run."""
    import threading
    import time

    hf, snap = pair
    text = "héllo wörld 🙂 <|im_start|> " * 40_000
    gaps, done = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.02)
    started = time.perf_counter()
    ids = snap.encode(text)
    took = time.perf_counter() - started
    done.set()
    t.join()
    assert ids == hf.encode(text) and len(ids) > 100_000
    assert max(gaps) < max(0.1, took / 2), (max(gaps), took)  # held throughout, the gap was the whole encode


def test_token_bytes_join_into_the_text_where_tokens_split_a_character(pair):
    """OpenAI's logprobs `bytes`: a token holding part of a character carries those bytes, not U+FFFD's."""
    for tok in pair:
        for text in ("👩👩 ok", "héllo ✓ wörld 🙂"):
            ids = tok.encode(text, add_special_tokens=False)
            assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
            assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case: some token alone is not text


_WORDS = ["hello", " world", " ", "   ", "\n", "\n\n", "\t", "\r\n", "é", "🙂"]
_PIECES = st.one_of(st.sampled_from(SPECIALS + _WORDS), st.text(max_size=8), st.characters(categories=["Cs"]))


def _outcome(f, *args):
    try:
        return f(*args)
    except Exception as e:  # both must fail the same way (a lone surrogate: a TypeError, as today)
        return type(e)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_PIECES, max_size=12), ids=st.lists(st.integers(0, VOCAB - 1), max_size=16))
def test_encode_and_decode_equal_transformers(pair, pieces, ids):
    hf, snap = pair
    text = "".join(pieces)
    for special in (True, False):
        got = _outcome(snap.encode, text, special)
        assert got == _outcome(hf.encode, text, special)
        if isinstance(got, list):
            ids = got + ids
    for skip in (True, False):
        assert snap.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def _render(tok, msgs, **kw):
    try:
        return tok.apply_chat_template(msgs, **kw)
    except InvalidRequestError as e:
        return "400", e.param


@pytest.mark.parametrize("template", [None, QWEN_TEMPLATE, RICH_TEMPLATE], ids=["gguf", "qwen", "rich"])
def test_chat_templates_render_as_transformers_renders_them(pair, template):
    hf, snap = pair
    if template is not None:  # model.chat_template replaces the checkpoint's own in both
        hf = _transformers(Path(hf.name), template)
        snap = SnapshotTokenizer.load(snap.name, chat_template=template)
    cases = [dict(add_generation_prompt=g, tools=t) for g in (True, False) for t in (None, [WEATHER, TIME])]
    cases += [dict(add_generation_prompt=False, continue_final_message=True),
              dict(enable_thinking=False), dict(bos_token="[BOS]", extra={"a": [1, {"b": None}]})]
    for msgs in CHATS:
        for kw in cases:
            want = _render(hf, msgs, **kw)
            assert _render(snap, msgs, **kw) == want, (msgs, kw)
            assert isinstance(want, str) or kw.get("continue_final_message"), want  # only a continuation may not fit
    assert "Once upon a" == _render(snap, CHATS[2], add_generation_prompt=False, continue_final_message=True)[-11:]


def test_template_errors_and_renderer_arguments_are_the_same_400s(pair):
    hf, snap = pair
    hf = _transformers(Path(hf.name), QWEN_TEMPLATE)
    snap = SnapshotTokenizer.load(snap.name, chat_template=QWEN_TEMPLATE)
    bad = [([{"role": "developer", "content": "x"}], {}, "messages", "developer messages are not supported"),
           ([], {}, "messages", "empty conversation"),
           ([{"role": "user", "content": "x"}], {"tokenize": True}, "chat_template_kwargs.tokenize", "may not set"),
           ([{"role": "user", "content": "x"}], {"conversations": []}, "chat_template_kwargs.conversations",
            "may not set"),
           # (messages is positional-only: a chat_template_kwargs key of that name reaches the check)
           ([{"role": "user", "content": "x"}], {"messages": []}, "chat_template_kwargs.messages", "may not set"),
           ([{"role": "user"}], {"add_generation_prompt": False, "continue_final_message": True}, "messages",
            "no \"content\" to continue")]
    for msgs, kw, param, text in bad:
        for tok in (hf, snap):
            with pytest.raises(InvalidRequestError, match=text) as e:
                tok.apply_chat_template(msgs, **kw)
            assert e.value.param == param


def test_several_named_templates_pick_tool_use_with_tools(caches, tmp_path):
    """A tokenizer_config.json naming several templates: "tool_use" when there are tools, else "default"."""
    d = _cache_copy(caches["qwen2"][2], tmp_path / "named")
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}{{ eos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf, snap = _build(str(d)), _build(str(d))
    assert isinstance(snap, SnapshotTokenizer) and snap.chat_template == hf.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    for tok in (hf, snap):
        assert tok.apply_chat_template(msgs) == "Dhi"
        assert tok.apply_chat_template(msgs, tools=[WEATHER]) == "T1<|im_end|>"


@pytest.mark.parametrize("damage", ["truncated", "other version", "short vocabulary", "bad pipeline",
                                    "another transformers"])
def test_a_damaged_snapshot_falls_back_to_transformers_and_is_rewritten(pair, tmp_path, caplog, damage):
    hf, _ = pair
    d = _cache_copy(Path(hf.name), tmp_path / "c")
    _build(str(d))
    data = json.loads(snapshot.path(d).read_text())
    if damage == "truncated":
        snapshot.path(d).write_text(json.dumps(data)[:1000])
    else:
        if damage == "other version":
            data["version"] = 0
        elif damage == "another transformers":
            data["transformers"] = "4.0.0"
        elif damage == "short vocabulary":
            data["vocab_size"] -= 1
        else:
            data["backend"] = "{}"
        snapshot.path(d).write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="llmserve.tokenizers"):
        tok = _build(str(d))
    assert isinstance(tok, HFTokenizer) and "not used" in caplog.text and snapshot.FILE in caplog.text
    again = _build(str(d))
    assert isinstance(again, SnapshotTokenizer) and again.encode("hello world") == hf.encode("hello world")


def test_decode_cleans_up_spaces_where_the_config_asks(tmp_path):
    """clean_up_tokenization_spaces (a WordPiece-style tokenizer's, not BPE's: transformers skips it there)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "hello", ",", "world", ".", "do", "n't", "'s", "?"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>",
                            clean_up_tokenization_spaces=True).save_pretrained(tmp_path)
    (tmp_path / snapshot.GGUF_CACHE_MARKER).write_text("{}")  # as if llmserve's GGUF cache held it
    hf, snap = _build(str(tmp_path)), _build(str(tmp_path))
    assert isinstance(snap, SnapshotTokenizer)
    ids = hf.encode("hello , world . do n't ? <eos>")
    for skip in (True, False):
        assert snap.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert snap.decode(ids) == "hello, world. don't?"


def test_a_users_own_checkpoint_directory_gets_no_snapshot(pair, tmp_path):
    """Only llmserve's GGUF cache is written into."""
    hf, _ = pair
    d = _cache_copy(Path(hf.name), tmp_path / "mine")
    (d / "llmserve-gguf.json").unlink()
    assert isinstance(_build(str(d)), HFTokenizer) and not snapshot.path(d).exists()


@pytest.fixture(scope="module")
def snapshot_server(caches):
    """A server (fake backend: the model does not matter here) whose hf tokenizer is the Qwen2 cache's snapshot."""
    from tests.server.conftest import start_server

    entry = caches["qwen2"][2]
    s = start_server({"backend": {"name": "fake", "options": {"vocab_size": VOCAB, "eos_token_id": 2}},
                      "model": {"model": "embedded", "tokenizer": str(entry), "max_model_len": 4096,
                                "served_model_name": "tiny", "chat_template": QWEN_TEMPLATE},
                      "tokenizer": {"name": "hf"}})
    yield s, entry
    s.stop()


def test_a_server_on_the_snapshot_renders_and_counts_as_transformers(snapshot_server):
    import httpx

    s, entry = snapshot_server
    assert isinstance(s.engine.tokenizer, SnapshotTokenizer)
    msgs = CHATS[1][:4] + [{"role": "user", "content": "and now?"}]
    ref = _transformers(entry, QWEN_TEMPLATE)
    want = ref.encode(ref.apply_chat_template(msgs, tools=[WEATHER], enable_thinking=False), add_special_tokens=False)
    # on the wire a call's arguments are a JSON string (the server hands the template the object)
    wire = json.loads(json.dumps(msgs))
    wire[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(CALL["function"]["arguments"])
    msgs = wire
    body = {"model": "tiny", "messages": msgs, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(s.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    out = s.client().chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=2,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.usage.prompt_tokens == len(want)


@pytest.mark.parametrize("kwargs, param", [({"messages": []}, "chat_template_kwargs.messages"),
                                           ({"tokenize": True}, "chat_template_kwargs.tokenize")])
def test_a_server_on_the_snapshot_refuses_renderer_arguments(snapshot_server, kwargs, param):
    import openai

    s, _ = snapshot_server
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == param and "may not set" in e.value.body["message"]


def test_a_later_start_does_not_import_transformers(caches):
    """The engine on a cached GGUF (its snapshot written by the first start) never imports transformers."""
    path, root, entry = caches["qwen2"]
    code = ("import sys; from llmserve.engine import Engine; "
            f"e = Engine.from_config({{'model': {{'model': {str(path)!r}}}, "
            "'backend': {'kv_cache_memory': '4MiB'}}); "
            "assert type(e.tokenizer).__name__ == 'SnapshotTokenizer', type(e.tokenizer); "
            "print(e.tokenizer.encode('hello world')); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    from llmserve_torch import kernel_library

    # the GGUF cache is the test's, the built CPU kernels this machine's (not compiled again into the test's cache)
    env = {**os.environ, "LLMSERVE_CACHE": str(root), "LLMSERVE_CACHE_DIR": str(kernel_library.cache_dir()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ids, modules = r.stdout.strip().splitlines()[-2:]
    assert modules == "[]" and json.loads(ids) == _transformers(entry).encode("hello world")
