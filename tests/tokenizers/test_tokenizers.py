"""The default tokenizers, loaded through the plugin registry the way the engine loads them."""

from __future__ import annotations

import json

import pytest

from llmserve.config import config_from_dict
from llmserve.errors import ConfigError, InvalidRequestError
from llmserve.plugins import load_plugins


def _build(name: str, **config) -> object:
    ps = load_plugins(defaults=("llmserve_tokenizers",), entry_points=False)
    cfg = config_from_dict(config)
    return ps.get("tokenizer", name).factory(cfg)


def test_byte_tokenizer_ids_are_bytes_and_round_trip():
    tok = _build("byte")
    text = "héllo wörld\n  ✓ <|endoftext|>"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # a literal EOS string in user text stays bytes
    assert tok.decode(ids) == text
    assert tok.vocab_size == 257 and tok.eos_token_id == 256
    assert tok.decode(ids + [256]) == text
    assert tok.decode([104, 256], skip_special_tokens=False) == "h<|endoftext|>"
    assert tok.token_bytes(0xC3) == b"\xc3"
    # a cut multi-byte character decodes to U+FFFD instead of raising
    assert tok.decode([0xC3]) == "\ufffd"


def test_printable_tokenizer_shows_every_byte_as_one_printable_character():
    tok = _build("printable")
    every = tok.decode(list(range(256)))
    assert len(every) == 256 and len(set(every)) == 256
    assert all(c.isprintable() or c in "\t\n" for c in every)
    assert tok.decode(list(b"Hello, world!\n")) == "Hello, world!\n"  # ASCII text is itself
    assert tok.encode(every) == list(range(256))  # whatever it writes reads back as the same ids
    assert tok.encode("café") == list(b"caf") + [0xE9]  # printable Latin-1 is one byte, as in the table
    assert tok.decode(tok.encode("✓")) == tok.decode(list("✓".encode()))  # other text: its UTF-8 bytes
    assert tok.decode([104, 256], skip_special_tokens=False) == "h<|endoftext|>"
    assert tok.token_bytes(0) == tok.decode([0]).encode() and tok.vocab_bytes()[7] == tok.decode([7]).encode()


def test_byte_chat_template_is_the_documented_one():
    tok = _build("byte")
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]
    assert tok.apply_chat_template(msgs) == "system: be brief\nuser: hi!\nassistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: be brief\nuser: hi!\n"


def test_byte_rejects_unknown_options():
    with pytest.raises(ConfigError, match="unknown option"):
        _build("byte", tokenizer={"name": "byte", "options": {"lowercase": True}})


def _engine_tokenizer(**config):
    from llmserve.engine import Engine

    return Engine.from_config({**config, "tokenizer": {"name": "auto"}}).tokenizer


def test_auto_is_the_backends_choice_byte_for_embedded_and_fake():
    from llmserve_tokenizers.byte import ByteTokenizer, PrintableByteTokenizer

    assert isinstance(_engine_tokenizer(model={"model": "embedded"}, backend={"kv_cache_memory": "4MiB"}),
                      PrintableByteTokenizer)
    assert isinstance(_engine_tokenizer(model={"model": "/nonexistent"}, backend={"name": "fake"}), ByteTokenizer)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny word-level HF tokenizer with a chat template, saved to a local directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5, ":": 6}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant :{% endif %}")
    d = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(d)
    return d


def test_hf_tokenizer_loads_a_local_directory(hf_dir):
    from llmserve_tokenizers.hf import HFTokenizer

    tok = _build("hf", model={"model": str(hf_dir)})
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.decode([2, 3, 1]) == "hello world"
    assert tok.eos_token_id == 1 and tok.vocab_size == 7
    assert 1 in tok.all_special_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "user : hello assistant :"
    assert tok.encode(prompt) == [4, 6, 2, 5, 6]


def test_auto_picks_hf_for_a_checkpoint_and_model_tokenizer_wins(hf_dir, tmp_path):
    from transformers import GPT2Config

    from llmserve_tokenizers.hf import HFTokenizer

    GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=7, n_positions=64).save_pretrained(tmp_path)
    tok = _engine_tokenizer(model={"model": str(tmp_path), "tokenizer": str(hf_dir), "load_format": "dummy"},
                            backend={"kv_cache_memory": "4MiB"})
    assert isinstance(tok, HFTokenizer) and tok.encode("world") == [3]


def test_hf_without_chat_template_is_a_clear_400(hf_dir, tmp_path):
    cfg_path = hf_dir / "tokenizer_config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("chat_template", None)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in hf_dir.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps(data))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tok = _build("hf", model={"model": str(plain)})
    with pytest.raises(InvalidRequestError, match="no chat template") as e:
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert e.value.param == "messages"


def test_hf_missing_directory_offline_says_to_use_a_local_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # (the online path is not exercised: without internet the hub client retries for ~45 s)
    with pytest.raises(ConfigError, match="cannot load the tokenizer.*local directory"):
        _build("hf", model={"model": "no-such-org/no-such-model"})


def test_hf_refuses_the_embedded_model():
    with pytest.raises(ConfigError, match="embedded"):
        _build("hf", model={"model": "embedded"})
