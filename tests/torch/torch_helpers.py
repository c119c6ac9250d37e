"""Helpers for the torch backend tests: tiny HF models, backend construction, a hand-played scheduler."""

from __future__ import annotations

import random

import torch
import transformers

from llmserve.batch import SchedulerOutput, ScheduledRequest
from llmserve.config import config_from_dict
from llmserve.request import SamplingParams


def make_gpt2(seed: int = 0, **kw):
    """A tiny random GPT-2 (HF) in eval mode."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=kw.pop("vocab_size", 211), n_positions=256, n_embd=64, n_layer=2,
                                  n_head=4, eos_token_id=7, bos_token_id=7, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


def make_qwen2(seed: int = 0, tie: bool = False, **kw):
    """A tiny random Qwen2 (HF) with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=kw.pop("vocab_size", 223), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, tie_word_embeddings=tie, eos_token_id=5,
                                   bos_token_id=5, **kw)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initializes biases to zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    return model


def make_llama(rope_parameters: dict, seed: int = 0, max_positions: int = 256, vocab_size: int = 211):
    """A tiny random Llama (HF) with the given RoPE settings; weights large enough that positions matter."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   rope_parameters=dict(rope_parameters), initializer_range=0.2, eos_token_id=5,
                                   bos_token_id=5)
    return transformers.LlamaForCausalLM(cfg).eval()


def backend_config(model: str, attention: str = "auto", dtype: str = "float32", linear: str = "auto",
                   options: dict | None = None, **model_kw):
    """An EngineConfig for the torch backend with a small KV budget."""
    return config_from_dict({
        "model": {"model": model, "dtype": dtype, **model_kw},
        "backend": {"name": "torch", "kv_cache_memory": "16MiB",
                    "options": {"attention": attention, "linear": linear, **(options or {})}},
    })


def make_backend(model: str, attention: str = "auto", dtype: str = "float32", block_size: int = 4,
                 linear: str = "auto", options: dict | None = None, **model_kw):
    """A TorchBackend with its KV cache initialized."""
    from llmserve_torch.backend import TorchBackend

    b = TorchBackend(backend_config(model, attention, dtype, linear, options, **model_kw))
    b.init_kv_cache(b.num_kv_blocks(block_size), block_size)
    return b


class Driver:
    """Plays scheduler + allocator by hand: shuffled (non-contiguous) blocks, chunked prefill, decode."""

    def __init__(self, backend, seed: int = 0):
        self.b = backend
        self.bs = backend.kv.block_size
        self.free = list(range(backend.kv.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def ensure(self, rid: str, num_tokens: int) -> list[int]:
        t = self.tables.setdefault(rid, [])
        while len(t) * self.bs < num_tokens:
            t.append(self.free.pop())
        return t

    def request(self, rid, token_ids, computed, new, sampling=None, prompt_len=None, do_sample=True):
        table = self.ensure(rid, computed + new)
        prompt_len = len(token_ids) if prompt_len is None else prompt_len
        return ScheduledRequest(rid, token_ids, computed, new, table, sampling or SamplingParams(temperature=0.0),
                                do_sample, prompt_len, max(0, len(token_ids) - prompt_len))


def batch_of(reqs):
    """A SchedulerOutput with its token counts filled in."""
    pre = sum(r.num_new_tokens for r in reqs if r.num_new_tokens > 1)
    dec = sum(r.num_new_tokens for r in reqs if r.num_new_tokens == 1)
    return SchedulerOutput(requests=list(reqs), num_prefill_tokens=pre, num_decode_tokens=dec)


def generate(engine, prompts, sp) -> list[list[int]]:
    """Every prompt through `engine` until done: each request's tokens, in prompt order (no request may fail)."""
    ids = [engine.add_request(p, sp) for p in prompts]
    got: dict = {}
    while engine.has_unfinished:
        for o in engine.step().outputs:
            assert o.error is None, o.error
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[i] for i in ids]


def attention_arch(heads: int, kv_heads: int, head_dim: int):
    """A one-layer Qwen2-shaped ArchConfig with these heads, for the attention kernels' tests."""
    from llmserve_torch.arch import ArchConfig

    return ArchConfig(family="decoder", model_type="qwen2", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=8,
                      num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096)


def step_metadata(reqs, block_size: int, num_blocks: int, seed: int, device="cpu"):
    """reqs: (computed, new) per request → StepMetadata over shuffled blocks."""
    from llmserve_torch.attention import StepMetadata

    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    slots, tok_req, tok_pos, tables, q_starts, q_lens, ctx_lens = [], [], [], [], [], [], []
    for ri, (s, n) in enumerate(reqs):
        ctx = s + n
        bt = [free.pop() for _ in range(-(-ctx // block_size))]
        q_starts.append(len(slots))
        q_lens.append(n)
        ctx_lens.append(ctx)
        tables.append(bt)
        for p in range(s, ctx):
            slots.append(bt[p // block_size] * block_size + p % block_size)
            tok_req.append(ri)
            tok_pos.append(p)
    maxb = max(len(t) for t in tables)
    flat = [b for t in tables for b in t + [0] * (maxb - len(t))]
    return StepMetadata(
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        tok_req=torch.tensor(tok_req, dtype=torch.int32, device=device),
        tok_pos=torch.tensor(tok_pos, dtype=torch.int32, device=device),
        block_tables=torch.tensor(flat, dtype=torch.int32, device=device).view(len(tables), maxb),
        q_starts=q_starts, q_lens=q_lens, ctx_lens=ctx_lens, num_tokens=len(slots))
