"""GGUF checkpoints: names, Q/K permutation and transposes undone, every supported type dequantized as
gguf-py does, the tokenizer and chat template from metadata, the conversion cache, clear errors."""

from __future__ import annotations

import copy
import logging
import math
import threading
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_helpers import VOCAB, dequantize, gguf_tensors, make_decoder, quantize, write_gguf
from torch_helpers import Driver, batch_of, make_backend, make_gpt2, make_llama, make_qwen2

from llmserve.config import ModelConfig, config_from_dict
from llmserve.engine import Engine
from llmserve.errors import ConfigError
from llmserve.request import SamplingParams
from llmserve_torch import cache_paths, gguf_cache, gguf_file, packed_cache, sources
from llmserve_torch.arch import Rope
from llmserve_torch.loader import load_model
from llmserve_torch.models.rope import default_inv_freq, inv_freq
from llmserve_torch.quant import QuantWeight

ARCHS = ["llama", "qwen2", "qwen3", "gpt2"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test converts into its own cache directory."""
    d = tmp_path / "cache"
    monkeypatch.setenv("LLMSERVE_CACHE", str(d))
    return d


def _hf(arch: str):
    if arch == "gpt2":
        return make_gpt2(vocab_size=VOCAB)
    if arch == "qwen2":
        return make_qwen2(vocab_size=VOCAB)
    return make_decoder(arch)


@pytest.fixture(scope="module", params=ARCHS)
def f32_pair(request, tmp_path_factory):
    """(safetensors dir, F32 GGUF path) of the same tiny model."""
    hf = _hf(request.param)
    d = tmp_path_factory.mktemp(f"st-{request.param}")
    hf.save_pretrained(d)
    return d, write_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", hf)


def _load(model: str):
    """The source's result with every tensor dequantized (the path the conversion cache serves)."""
    return sources.find_source(model).load(ModelConfig(model=model, quantization="none"))


def test_f32_gguf_gives_the_safetensors_arch_and_tensors_bit_for_bit(f32_pair):
    st_dir, path = f32_pair
    ref, got = _load(str(st_dir)), _load(str(path))
    # GGUF metadata holds floats as float32, as llama.cpp and transformers' GGUF loader read them
    assert got.arch == replace(ref.arch, norm_eps=float(np.float32(ref.arch.norm_eps)))
    assert got.state_dict.keys() == ref.state_dict.keys()
    for name, t in ref.state_dict.items():
        assert torch.equal(got.state_dict[name], t), name


def _greedy(model: str, prompts, n: int = 12, scheduler: int | None = None) -> list[list[int]]:
    """Greedy tokens; scheduler: a max_num_batched_tokens that makes long prompts prefill in chunks."""
    eng = Engine.from_config(config_from_dict({
        "model": {"model": model}, "tokenizer": {"name": "none"}, "backend": {"kv_cache_memory": "4MiB"},
        "cache": {"block_size": 4},
        **({"scheduler": {"max_num_batched_tokens": scheduler, "max_num_seqs": 4}} if scheduler else {})}))
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_unfinished:
        for o in eng.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    return [got[i] for i in ids]


def test_f32_gguf_is_greedy_token_identical_to_safetensors(f32_pair):
    st_dir, path = f32_pair
    prompts = [[9, 40, 77, 3, 120], list(range(8, 40)), [200]]
    assert _greedy(str(path), prompts) == _greedy(str(st_dir), prompts)


# every supported type; K-quants need rows of 256, hence the wider model
QUANT_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def wide_llama():
    return make_decoder("llama", hidden=256, seed=3)


def _dequantized(hf, qtype: str):
    """A copy of hf whose matrices hold gguf-py's dequantization of them quantized as the file holds them.

    Quantization works on blocks within a row, so quantizing the unpermuted HF matrix gives the
    file's blocks in another row order: the loader's unpermuted result must equal this exactly.
    GPT-2's Conv1D matrices are stored transposed, so they are quantized that way.
    """
    gpt2 = hf.config.model_type == "gpt2"
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in out.named_parameters():  # a tied head is not listed twice
            if p.ndim != 2:
                continue
            conv1d = gpt2 and not name.endswith(("wte.weight", "wpe.weight"))
            w = p.numpy().T if conv1d else p.numpy()
            w = dequantize(quantize(np.ascontiguousarray(w), qtype), qtype)
            p.copy_(torch.from_numpy(np.ascontiguousarray(w.T) if conv1d else w))
    return out


def _check_against_dequantized(path, hf, qtype: str) -> None:
    """Our weights equal gguf-py's dequantization, and our logits equal HF's with those weights."""
    ref_model = _dequantized(hf, qtype)
    ref = ref_model.state_dict()
    prefix = "transformer." if hf.config.model_type == "gpt2" else ""
    got = _load(str(path)).state_dict
    for name, t in got.items():  # matrices dequantized, norms and biases as they were (float32)
        assert torch.equal(t.float(), ref[prefix + name]), name
    ids = [5, 17, 99, 140, 33, 60, 7, 250]
    b = make_backend(str(path), quantization="none")
    logits = b.compute_logits(batch_of([Driver(b).request("x", ids, 0, len(ids))]))
    with torch.no_grad():
        want = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_each_quant_type_loads_as_gguf_dequantizes_it(tmp_path, wide_llama, qtype):
    path = write_gguf(tmp_path / f"{qtype}.gguf", wide_llama, qtype)
    assert qtype in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}  # the file really holds it
    _check_against_dequantized(path, wide_llama, qtype)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_quantized_qwen2_and_gpt2_load_as_gguf_dequantizes_them(tmp_path, arch):
    hf = make_gpt2(seed=4, vocab_size=VOCAB) if arch == "gpt2" else make_decoder("qwen2", seed=4)
    _check_against_dequantized(write_gguf(tmp_path / "q8.gguf", hf, "Q8_0"), hf, "Q8_0")


def test_reference_k_quantizers_round_trip_within_their_error():
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    for qtype, bound in (("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.03)):
        y = dequantize(quantize(x, qtype), qtype)
        assert np.sqrt(((y - x) ** 2).mean()) < bound * np.sqrt((x ** 2).mean()), qtype


# --- the conversion cache ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    hf = make_decoder("llama", seed=5)
    return write_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", hf, "Q8_0"), hf


def _counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = gguf_file.dequantize

    def counted(tensor):
        calls.append(tensor.name)
        return real(tensor)

    monkeypatch.setattr(gguf_file, "dequantize", counted)
    return calls


def test_second_load_reads_the_cache_without_dequantizing(llama_gguf, cache, monkeypatch, caplog):
    path, _ = llama_gguf
    calls = _counting(monkeypatch)
    with caplog.at_level(logging.INFO, logger="llmserve.torch"):
        first = _load(str(path))
        assert len(calls) == len(gguf.GGUFReader(path).tensors)
        assert "first load" in caplog.text and "dequantized in" in caplog.text and "hashing" in caplog.text
        caplog.clear()
        second = _load(str(path))
    assert len(calls) == len(gguf.GGUFReader(path).tensors)  # nothing more was dequantized
    assert "reading the dequantized checkpoint" in caplog.text and "reading the tokenizer" in caplog.text
    assert "first load" not in caplog.text and "hashing" not in caplog.text  # the sha256 was remembered
    for name, t in first.state_dict.items():
        assert torch.equal(second.state_dict[name], t)
    sha = gguf_cache.file_sha256(path, cache / "gguf" / "sha256.json")
    meta, dense = cache / "gguf" / sha, cache / "gguf" / f"{sha}-dense"
    assert second.tokenizer_dir == str(meta)
    assert {"tokenizer.json", "generation_config.json", gguf_cache.MARKER} <= {p.name for p in meta.iterdir()}
    assert {"config.json", "model.safetensors", gguf_cache.MARKER} <= {p.name for p in dense.iterdir()}


def test_a_quantized_load_writes_no_dequantized_weights(llama_gguf, cache, monkeypatch):
    """The default (quantization auto) repacks the file's blocks: only the float tensors (norms) are read as floats,
    and the cache holds the tokenizer, never a dequantized copy."""
    path, _ = llama_gguf
    calls = _counting(monkeypatch)
    res = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    res.finish()  # (the tokenizer export ran beside the load)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert calls and all(types[n] == "F32" for n in calls)
    assert any(isinstance(v, QuantWeight) for v in res.state_dict.values())
    (entry,) = [p for p in (cache / "gguf").iterdir() if p.is_dir()]
    assert res.tokenizer_dir == str(entry) and not (entry / "model.safetensors").exists()


def test_a_first_start_exports_the_tokenizer_beside_the_weights(llama_gguf, cache, monkeypatch):
    """The first load of a file returns its weights while transformers still builds the tokenizer on a thread of its
    own; finish() waits for it and gives the tokenizer directory and generation defaults. Another load meanwhile
    waits for the same export (it runs once), and a failing export's error reaches the waiter."""
    path, _ = llama_gguf
    gate, calls, real = threading.Event(), [], gguf_cache.export_tokenizer

    def slow_export(p, out):
        calls.append(p)
        assert gate.wait(30)
        return real(p, out)

    monkeypatch.setattr(gguf_cache, "export_tokenizer", slow_export)
    res = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    assert res.tokenizer_dir is None and any(isinstance(v, QuantWeight) for v in res.state_dict.values())
    other = threading.Thread(target=lambda: sources.find_source(str(path)).load(ModelConfig(model=str(path))).finish())
    other.start()
    gate.set()
    res.finish()
    other.join(30)
    assert calls == [path] and (Path(res.tokenizer_dir) / "tokenizer.json").is_file()
    assert res.generation.eos_token_ids

    def broken(p, out):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_cache, "export_tokenizer", broken)
    monkeypatch.setenv("LLMSERVE_CACHE", str(cache.parent / "other"))
    res = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    with pytest.raises(OSError, match="disk full"):
        res.finish()


def test_a_later_start_reads_the_packed_linears_back_and_computes_the_same_logits(tmp_path, cache, monkeypatch):
    """The first quantized load caches each linear's packed tensor; the next reads no quantized tensor from the file
    (the tied embedding is the head's packed weight) and its logits are equal to the bit; an unreadable cache is
    repacked and rewritten."""
    path = write_gguf(tmp_path / "q.gguf", make_decoder("qwen2", seed=3), "Q4_0")
    ids = list(range(3, 40))

    def logits_and_repacked():
        seen = []
        real = gguf_file.repack
        monkeypatch.setattr(gguf_file, "repack", lambda t: (q := real(t)) is not None and seen.append(t.name) or q)
        b = make_backend(str(path))
        out = b.compute_logits(batch_of([Driver(b).request("x", ids, 0, len(ids))]))
        return out, seen, b.loaded.weights

    first, repacked, weights = logits_and_repacked()
    packed_cache.wait_for_saves()  # (written on a thread while the first start goes on)
    (packed,) = (cache / "gguf").glob("*/packed-*.safetensors")
    assert "repacked" in weights and any(n.startswith("blk.") for n in repacked)
    second, repacked, weights = logits_and_repacked()
    assert "packed cache" in weights and repacked == []
    assert torch.equal(first, second)
    packed.write_bytes(b"not a safetensors file")
    third, repacked, weights = logits_and_repacked()
    packed_cache.wait_for_saves()
    assert "repacked" in weights and torch.equal(first, third)
    assert packed.stat().st_size > 1000  # written again


def test_a_first_start_serves_while_its_packed_cache_is_written(tmp_path, cache, monkeypatch):
    """The packed cache is written on a thread: the first start's backend is made while the write still waits;
    a later load of the same file in this process waits for it and reads it back."""
    import safetensors.torch

    path = write_gguf(tmp_path / "q.gguf", make_decoder("qwen2", seed=4), "Q4_0")
    gate, real = threading.Event(), safetensors.torch.save_file

    def slow_save(*args, **kwargs):
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", slow_save)
    make_backend(str(path))
    assert not list((cache / "gguf").glob("*/packed-*.safetensors"))  # still writing, and the backend is made
    gate.set()
    later = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    assert later.packed.entries and "packed cache" in later.weights


def test_a_first_quantized_load_reads_each_linear_only_when_the_model_makes_it(tmp_path, cache):
    """Linear weights and the tied embedding stand in the state dict as Deferred (nothing unpacked yet) on a first
    start, as Packed once the cache holds them; norms are read as they are."""
    from llmserve_torch.packed_cache import Deferred, Packed

    path = write_gguf(tmp_path / "q.gguf", make_decoder("qwen2", seed=3), "Q4_0")
    first = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    linears = [k for k in first.state_dict if k.endswith("_proj.weight")] + ["model.embed_tokens.weight"]
    assert len(linears) > 1 and all(type(first.state_dict[k]) is Deferred for k in linears)
    assert type(first.state_dict["model.norm.weight"]) is torch.Tensor
    make_backend(str(path))  # builds the model: the deferred weights are read, the packed cache written
    later = sources.find_source(str(path)).load(ModelConfig(model=str(path)))
    assert all(type(later.state_dict[k]) is Packed for k in linears)


def test_the_reader_facade_gives_transformers_the_values_gguf_reader_gives(llama_gguf, tmp_path):
    """export_tokenizer hands transformers our reader's facade: every field parses to GGUFReader's value, and the
    tokenizer files written are byte for byte the ones transformers writes with GGUFReader itself."""
    from transformers import AutoTokenizer
    from transformers.integrations.ggml import _gguf_parse_value

    from llmserve_torch.gguf_reader import GGUFFile, ReaderFacade

    path, _ = llama_gguf
    real, facade = gguf.GGUFReader(path), ReaderFacade(GGUFFile(path))
    keys = [k for k in real.fields if not k.startswith("GGUF.")]
    assert keys == list(facade.fields)
    for k in keys:
        want, got = real.fields[k], facade.fields[k]
        assert [int(t) for t in got.types] == [int(t) for t in want.types], k
        assert [_gguf_parse_value(got.parts[i], got.types) for i in got.data] == \
            [_gguf_parse_value(want.parts[i], want.types) for i in want.data], k
    assert [t.name for t in facade.tensors] == [t.name for t in real.tensors]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert gguf_cache.export_tokenizer(path, ours)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(theirs))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert all((ours / p.name).read_bytes() == p.read_bytes() for p in theirs.iterdir())


def test_a_directory_holding_one_gguf_loads_it(llama_gguf):
    path, _ = llama_gguf
    assert isinstance(sources.find_source(str(path.parent)), sources.GGUFSource)
    assert _load(str(path.parent)).source == str(path)


def test_cache_root_follows_llmserve_cache_then_xdg(monkeypatch, tmp_path):
    assert cache_paths.cache_root() == tmp_path / "cache"
    monkeypatch.delenv("LLMSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_paths.cache_root() == tmp_path / "xdg" / "llmserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_paths.cache_root() == tmp_path / "home" / ".cache" / "llmserve"


def test_an_interrupted_first_load_leaves_no_cache(llama_gguf, cache, monkeypatch):
    path, _ = llama_gguf
    real = gguf_file.dequantize
    calls = []

    def dies(tensor):
        calls.append(tensor.name)
        if len(calls) == 4:
            raise KeyboardInterrupt  # what a Ctrl-C mid-conversion raises
        return real(tensor)

    monkeypatch.setattr(gguf_file, "dequantize", dies)
    with pytest.raises(KeyboardInterrupt):
        _load(str(path))
    root = cache / "gguf"
    sha = gguf_cache.file_sha256(path, root / "sha256.json")
    # the tokenizer's entry was finished; the dequantized one left nothing, not even its temporary directory
    assert sorted(p.name for p in root.iterdir()) == [sha, "sha256.json"]
    orphan = root / f".tmp-{sha}-dense-{2**22 + 1}"  # left by a process that was killed (pids stay below 2**22)
    orphan.mkdir()
    monkeypatch.setattr(gguf_file, "dequantize", real)
    assert _load(str(path)).state_dict
    assert sorted(p.name for p in root.iterdir()) == [sha, f"{sha}-dense", "sha256.json"]


def test_a_cache_of_another_format_is_rebuilt(llama_gguf, cache, monkeypatch):
    path, _ = llama_gguf
    _load(str(path))
    calls = _counting(monkeypatch)
    monkeypatch.setattr(gguf_cache, "FORMAT", gguf_cache.FORMAT + 1)
    _load(str(path))
    assert calls  # converted again
    calls.clear()
    _load(str(path))
    assert not calls


def test_dummy_load_format_reads_only_the_metadata(llama_gguf, cache):
    path, hf = llama_gguf
    res = sources.find_source(str(path)).load(ModelConfig(model=str(path), load_format="dummy"))
    assert res.weights.startswith("dummy") and res.arch.num_layers == hf.config.num_hidden_layers
    assert not cache.exists()


# --- tokenizer and chat template --------------------------------------------------------------------------

def test_engine_tokenizer_and_chat_template_come_from_the_gguf(llama_gguf):
    from transformers import AutoTokenizer

    path, _ = llama_gguf
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    eng = Engine.from_config(config_from_dict({"model": {"model": str(path)}, "backend": {"kv_cache_memory": "4MiB"}}))
    assert eng.config.model.tokenizer is None
    text = "hello world, the world"
    assert eng.tokenizer.encode(text) == ref.encode(text) and len(ref.encode(text)) < len(text)
    msgs = [{"role": "user", "content": "hello"}]
    rendered = eng.tokenizer.apply_chat_template(msgs)
    assert rendered == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert eng.eos_token_id == 2 and eng.tokenizer.eos_token_id == 2


# --- errors -----------------------------------------------------------------------------------------------

def test_an_unsupported_tensor_type_is_named(tmp_path, llama_gguf):
    _, hf = llama_gguf
    tensors = gguf_tensors(hf)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
    rows = tensors["blk.0.ffn_up.weight"].shape[0]
    tensors["blk.0.ffn_up.weight"] = (np.zeros((rows, 256 // block * nbytes), dtype=np.uint8), "Q2_K")
    path = write_gguf(tmp_path / "q2k.gguf", hf, tensors=tensors)
    with pytest.raises(ConfigError, match=r"type\(s\) Q2_K are not supported \(e\.g\. blk\.0\.ffn_up\.weight\); "
                                          "supported: F32"):
        _load(str(path))


def test_an_unknown_architecture_is_named(tmp_path, llama_gguf):
    _, hf = llama_gguf
    path = write_gguf(tmp_path / "mamba.gguf", hf, arch="mamba")
    with pytest.raises(ConfigError, match=r"architecture 'mamba' is not supported.*gemma, gpt2, llama, qwen2, qwen3"):
        load_model(ModelConfig(model=str(path)))


def test_path_errors(tmp_path, llama_gguf):
    path, _ = llama_gguf
    with pytest.raises(ConfigError, match="no such GGUF file"):
        _load(str(tmp_path / "missing.gguf"))
    (tmp_path / "a.gguf").write_bytes(path.read_bytes())
    (tmp_path / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        _load(str(tmp_path))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        _load(str(tmp_path / "junk.gguf"))
    with pytest.raises(ConfigError, match="load_format: 'safetensors' does not apply to a GGUF"):
        sources.find_source(str(path)).load(ModelConfig(model=str(path), load_format="safetensors"))


# --- the source registry ----------------------------------------------------------------------------------

def test_sources_are_tried_in_order_and_a_registered_one_comes_first(tmp_path, gpt2_dir):
    assert [type(sources.find_source(m)).__name__ for m in ("embedded", "x.gguf", str(gpt2_dir[0]), "org/model")] \
        == ["EmbeddedSource", "GGUFSource", "CheckpointSource", "CheckpointSource"]

    class Prefixed(sources.ModelSource):
        name = "prefixed"

        def matches(self, model):
            return model.startswith("mem:")

        def load(self, mc):
            return replace(sources.EmbeddedSource().load(mc), source=mc.model, weights="from memory")

    src = Prefixed()
    sources.register_source(src)
    try:
        loaded = load_model(ModelConfig(model="mem:tiny"))
    finally:
        sources.unregister_source(src)
    assert (loaded.source, loaded.weights, loaded.arch.model_type) == ("mem:tiny", "from memory", "gpt2")
    assert isinstance(sources.find_source("mem:tiny"), sources.CheckpointSource)


# --- Llama 3.1/3.2: llama3 RoPE scaling as llama.cpp's converter writes it, a rope_freqs tensor --------------

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def converter_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): each frequency's divisor, element by element
    in float32 tensors as the converter computes them; llama.cpp divides each base frequency by it."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@pytest.fixture(scope="module")
def llama3_pair(tmp_path_factory):
    """(safetensors dir, F32 GGUF with rope_freqs, the factors) of a tiny Llama with llama3 RoPE scaling."""
    hf = make_llama(LLAMA3, max_positions=256, vocab_size=VOCAB)
    d = tmp_path_factory.mktemp("st-llama3")
    hf.save_pretrained(d)
    factors = converter_rope_freqs(LLAMA3, 16)
    tensors = {**gguf_tensors(hf), "rope_freqs.weight": factors}
    return d, write_gguf(tmp_path_factory.mktemp("gguf") / "llama3.gguf", hf, tensors=tensors), factors


def test_rope_freqs_divide_the_frequencies_as_llama_cpp_does(llama3_pair):
    st_dir, path, factors = llama3_pair
    ref, got = _load(str(st_dir)).arch, _load(str(path)).arch
    assert got.rope == Rope(theta=10000.0, type="freq_factors", freq_factors=tuple(factors.tolist()))
    assert _load(str(path)).arch.rope == got.rope  # read back from the cached config.json unchanged
    assert (factors == 1).any() and (factors == 4).any()  # frequencies kept, scaled and (below) blended
    base, mine = default_inv_freq(10000.0, 16), inv_freq(got.rope, 16)
    assert torch.equal(mine, base / torch.from_numpy(factors))
    # the source's llama3 frequencies: the same where a factor is 1 or 4, within one float32 ulp in the blend band
    want = inv_freq(ref.rope, 16)
    plain = torch.from_numpy((factors == 1) | (factors == 4))
    assert torch.equal(mine[plain], want[plain]) and (~plain).any()
    assert ((mine.view(torch.int32) - want.view(torch.int32)).abs() <= 1).all()


def test_rope_freqs_gguf_is_greedy_token_identical_to_llama3_safetensors(llama3_pair):
    """Prompts past the original 64-token context, prefilled in chunks, then decoded."""
    st_dir, path, _ = llama3_pair
    rng = np.random.default_rng(11)
    prompts = [rng.integers(8, VOCAB, size=n).tolist() for n in (100, 70, 9)]
    assert _greedy(str(path), prompts, scheduler=32) == _greedy(str(st_dir), prompts, scheduler=32)


def test_rope_freqs_that_cannot_be_applied_exactly_are_refused(tmp_path, llama3_pair):
    factors = llama3_pair[2]
    hf = make_llama(LLAMA3, vocab_size=VOCAB)
    short = write_gguf(tmp_path / "short.gguf", hf, tensors={**gguf_tensors(hf), "rope_freqs.weight": factors[:4]})
    with pytest.raises(ConfigError, match=r"rope_freqs holds 4 values; expected head_dim/2 = 8"):
        _load(str(short))
    qwen = make_qwen2(vocab_size=VOCAB)
    path = write_gguf(tmp_path / "qwen2.gguf", qwen, tensors={**gguf_tensors(qwen), "rope_freqs.weight": factors})
    with pytest.raises(ConfigError, match=r"rope_freqs\) in a 'qwen2' GGUF is not supported"):
        _load(str(path))
