"""Gemma (models/gemma.py, a family added in one file): logits and greedy tokens equal transformers' on a tiny
checkpoint, through the loader, the backend and the engine; a GGUF written as llama.cpp's converter writes Gemma
(norm weights stored as 1 + w) loads to the same model; the fused C stack says why it does not run it."""

from __future__ import annotations

import gguf
import pytest
import torch
import transformers
from gguf_helpers import VOCAB, write_gguf
from test_engine_vs_hf import GREEDY, engine_for, hf_greedy, prompts, run
from test_models import KERNELS, assert_prefill_then_decode_match_hf, hf_logits
from torch_helpers import Driver, batch_of, make_backend

from llmserve.errors import ConfigError
from llmserve_torch.checkpoint import read_arch


def make_gemma(seed: int = 0, vocab_size: int = 211, **kw):
    """A tiny random Gemma (HF): head_dim 32 where hidden/heads is 16 (Gemma's head_dim comes from its config),
    grouped-query attention, norm weights away from zero (HF starts them at 0, which (1 + w) makes 1)."""
    torch.manual_seed(seed)
    cfg = transformers.GemmaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256, initializer_range=0.2, eos_token_id=5,
                                   bos_token_id=5, pad_token_id=0, **kw)
    model = transformers.GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny Gemma saved with save_pretrained; (dir, hf_model)."""
    d = tmp_path_factory.mktemp("gemma")
    hf = make_gemma()
    hf.save_pretrained(d)
    # hf_greedy's min_new_tokens would mask the EOS id (5) that this model's greedy decoding reaches; ours ignores it
    hf.generation_config.eos_token_id = None
    return d, hf


def test_the_config_maps_to_the_gemma_family(gemma_dir):
    arch = read_arch(gemma_dir[0])
    assert (arch.family, arch.model_type, arch.head_dim, arch.num_kv_heads, arch.activation) == \
        ("gemma", "gemma", 32, 2, "gelu_pytorch_tanh")
    assert arch.tie_word_embeddings and arch.q_size == 128 != arch.hidden_size and arch.context_bound == ""


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_then_decode_logits_match_hf(gemma_dir, kernel):
    """Two prompts prefilled in one flattened batch, then decoded together, in float32."""
    assert_prefill_then_decode_match_hf(*gemma_dir, kernel, (7, 29), 3)


def test_engine_greedy_tokens_equal_hf_generate_with_chunked_prefill(gemma_dir):
    path, hf = gemma_dir
    eng = engine_for(path, scheduler={"max_num_batched_tokens": 12, "max_num_seqs": 4})
    ps = prompts(hf.config.vocab_size, [3, 17, 30, 9])
    got, _, ids = run(eng, ps, GREEDY)
    for rid, p in zip(ids, ps):
        assert got[(rid, 0)] == hf_greedy(hf, p)


def test_the_fused_stack_names_gemma_as_why_it_does_not_run(gemma_dir):
    """Quantized linears would put a Llama-style model on the fused C stack; Gemma's GeGLU keeps it on Python."""
    b = make_backend(str(gemma_dir[0]), attention="auto", quantization="int8")
    assert b.stack is None
    assert b.describe()["fused_layers"] in ("it runs SiLU·up MLPs, not Gemma's GeGLU (nor its scaled embeddings)",
                                            "it runs with the cpu attention kernel")  # (no compiler: no cpu kernel)


def test_bidirectional_attention_is_refused(tmp_path):
    make_gemma(use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="use_bidirectional_attention is not supported"):
        read_arch(tmp_path)


def _converter_tensors(hf) -> dict:
    """The state dict as convert_hf_to_gguf's GemmaModel writes it: gguf-py's names, every norm weight + 1, no
    lm_head (tied)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA, hf.config.num_hidden_layers)
    out = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        base, kind = name.rsplit(".", 1)
        w = t.detach().float().numpy().copy()
        out[f"{names.get_name(base)}.{kind}"] = w + 1 if name.endswith("norm.weight") else w
    return out


@pytest.mark.parametrize("quantization", ["auto", "none"])  # served from the file, or from the dequantized cache
def test_a_gguf_of_gemma_gives_hf_logits(tmp_path, monkeypatch, quantization):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    hf = make_gemma(seed=1, vocab_size=VOCAB)
    path = write_gguf(tmp_path / "gemma.gguf", hf, tensors=_converter_tensors(hf), arch="gemma")
    b = make_backend(str(path), quantization=quantization)
    assert (b.arch.family, b.arch.head_dim) == ("gemma", 32)
    ids = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = b.compute_logits(batch_of([Driver(b).request("a", ids, 0, len(ids))]))
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
