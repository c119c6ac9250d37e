"""OnnxBackend: the exported decoder (export.py) run by onnxruntime on the CPU, its KV in our blocks.

Paging: K/V live in numpy arrays of num_blocks × block_size slots per layer, written and read through the block
tables the scheduler hands out, so the allocator's accounting, prefix-cache sharing and preemption hold as with
the torch backend. onnxruntime sees no pages: each sequence runs on its own, its past K/V gathered from its blocks
into one contiguous input, and the new K/V written back to its slots.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from llmserve.batch import ModelOutput, ScheduledRequest, SchedulerOutput
from llmserve.config import EngineConfig, check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import ModelBackend
from llmserve_onnx.export import exported
from llmserve_torch.kv_cache import budget_blocks
from llmserve_torch.sampling import Sampler, prompt_logprobs

log = logging.getLogger("llmserve.onnx")

OPTIONS = {
    # never size the cache beyond what max_num_seqs full-length sequences can use at once
    "cap_kv_blocks": True,
}

PAGING = ("per-sequence runs: each sequence's past K/V is gathered from its KV blocks into onnxruntime's past "
          "inputs and its new K/V written back to its block slots (blocks, prefix sharing and preemption as the "
          "allocator accounts them)")


class OnnxBackend(ModelBackend):
    """GPT-2 / Qwen2-family decoders exported to ONNX, on onnxruntime's CPU execution provider."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.options = check_options(config.backend.options, OPTIONS, "backend.options (onnx backend)")
        mc = config.model
        if mc.device not in ("cpu", "auto"):
            raise ConfigError(f"model.device: the onnx backend runs on the CPU, got {mc.device!r}")
        self.export = exported(mc)
        f = self.export.facts
        a = f["arch"]
        self.num_layers, self.kv_size, self.hidden_size = a["num_layers"], f["kv_size"], a["hidden_size"]
        self.vocab_size = a["vocab_size"]
        limit = a["max_position_embeddings"]
        if mc.max_model_len is not None:
            if f["context_bound"] and mc.max_model_len > limit:
                raise ConfigError(f"model.max_model_len: {mc.max_model_len} exceeds {f['context_bound']} ({limit})")
            limit = mc.max_model_len
        self.max_model_len = limit
        self.eos_token_id = a["eos_token_id"]
        self.eos_token_ids = frozenset(f["eos_token_ids"]) | {self.eos_token_id} - {None}
        self.generation_defaults = dict(f["generation_defaults"] or {})
        self.generation_defaults_source = f["generation_defaults_source"]
        self.default_tokenizer = "printable" if mc.model == "embedded" else "hf"
        self.tokenizer_path = f["tokenizer_dir"]
        so = ort.SessionOptions()
        if mc.threads is not None:
            so.intra_op_num_threads = mc.threads
        providers = ["CPUExecutionProvider"]
        self.decoder = ort.InferenceSession(str(self.export.decoder), so, providers=providers)
        self.head = ort.InferenceSession(str(self.export.head), so, providers=providers)
        self.past_names = [f"past_{kv}_{i}" for i in range(self.num_layers) for kv in "kv"]
        self.sampler = Sampler(torch.device("cpu"), seed=mc.seed, eos_token_ids=self.eos_token_ids)
        self.k: list[np.ndarray] = []  # per layer: [num_blocks * block_size, kv_size]
        self.v: list[np.ndarray] = []
        self.block_size = 0
        self._steps = 0
        self._sequence_runs = 0

    # --- KV cache -----------------------------------------------------------------------------

    def _bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.kv_size * 4  # float32 K and V of every layer

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks the kv_cache_memory budget holds, capped at what max_num_seqs full sequences can use."""
        per_block = self._bytes_per_block(block_size)
        n = budget_blocks(self.config.backend.kv_cache_memory, block_size, per_block, torch.device("cpu"))
        if self.options["cap_kv_blocks"]:
            n = min(n, -(-self.max_model_len // block_size) * self.config.scheduler.max_num_seqs + 1)
        if n < 1:
            raise ConfigError(f"backend.kv_cache_memory: holds no KV block (one block of {block_size} tokens "
                              f"takes {per_block} bytes)")
        return int(n)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One K and one V array a layer, of num_blocks × block_size slots."""
        slots = num_blocks * block_size
        self.k = [np.zeros((slots, self.kv_size), np.float32) for _ in range(self.num_layers)]
        self.v = [np.zeros((slots, self.kv_size), np.float32) for _ in range(self.num_layers)]
        self.block_size = block_size

    # --- one step -------------------------------------------------------------------------------

    def _slots(self, r: ScheduledRequest, start: int, end: int) -> np.ndarray:
        """The cache slots of positions [start, end) through r's block table."""
        bs = self.block_size
        need = -(-end // bs)
        if need > len(r.block_table):
            raise RuntimeError(f"request {r.request_id}: block table holds {len(r.block_table)} blocks, "
                               f"{end} tokens need {need}")
        p = np.arange(start, end)
        return np.asarray(r.block_table[:need], dtype=np.int64)[p // bs] * bs + p % bs

    def _run(self, r: ScheduledRequest) -> np.ndarray:
        """One sequence's chunk through the decoder: its K/V written to its slots; the chunk's hidden rows."""
        s, ctx = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
        past = self._slots(r, 0, s)
        feed = {"input_ids": np.asarray(r.token_ids[s:ctx], dtype=np.int64),
                "positions": np.arange(s, ctx, dtype=np.int64)}
        for i in range(self.num_layers):
            feed[f"past_k_{i}"] = self.k[i][past]
            feed[f"past_v_{i}"] = self.v[i][past]
        hidden, *new = self.decoder.run(None, feed)
        slots = self._slots(r, s, ctx)
        for i in range(self.num_layers):
            self.k[i][slots] = new[2 * i]
            self.v[i][slots] = new[2 * i + 1]
        self._sequence_runs += 1
        return hidden

    def _logits(self, hidden: np.ndarray) -> torch.Tensor:
        """float32 logits of hidden rows [N, hidden] (final norm and LM head)."""
        return torch.from_numpy(self.head.run(None, {"hidden": np.ascontiguousarray(hidden)})[0])

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Each sequence through the decoder, then one sampling pass over the rows that sample."""
        if not self.k:
            raise RuntimeError("init_kv_cache() must be called before execute()")
        reqs = batch.requests
        last_rows, plp = [], None
        for i, r in enumerate(reqs):
            hidden = self._run(r)
            if r.do_sample:
                last_rows.append(hidden[-1])
            if r.sampling.prompt_logprobs is not None:
                plp = plp or [None] * len(reqs)
                s, n = r.num_computed_tokens, r.num_new_tokens
                targets = [r.token_ids[p + 1] if p + 1 < r.num_prompt_tokens else None for p in range(s, s + n)]
                plp[i] = (prompt_logprobs(self._logits(hidden), targets, r.sampling.prompt_logprobs)
                          if any(t is not None for t in targets) else [None] * n)
        sampled: list[int | None] = [None] * len(reqs)
        logprobs = None
        rows = [i for i, r in enumerate(reqs) if r.do_sample]
        if rows:
            row_of = {i: k for k, i in enumerate(rows)}  # the mask's rows index reqs; the sampler's, the sampled
            toks, lps = self.sampler.sample(self._logits(np.stack(last_rows)), [reqs[i] for i in rows],
                                            batch.token_bitmask, [row_of[i] for i in batch.bitmask_rows])
            for i, tok, lp in zip(rows, toks, lps):
                sampled[i] = tok
                if lp is not None:
                    logprobs = logprobs or [None] * len(reqs)
                    logprobs[i] = lp
        self._steps += 1
        return ModelOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=plp)

    # --- reporting ------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Model, export, onnxruntime, and how the KV cache pages (what /stats shows)."""
        f = self.export.facts
        d = {"backend": "onnx", "model": f["source"], "model_type": f["arch"]["model_type"],
             "layers": self.num_layers, "vocab_size": self.vocab_size, "max_model_len": self.max_model_len,
             "dtype": "float32", "device": "cpu", "export": str(self.export.path), "opset": f["opset"],
             "onnxruntime": ort.__version__, "providers": self.decoder.get_providers(), "paging": PAGING,
             "steps": self._steps, "sequence_runs": self._sequence_runs}
        if self.k:
            d.update({"kv_blocks": self.k[0].shape[0] // self.block_size, "kv_block_size": self.block_size,
                      "kv_bytes": sum(a.nbytes for a in self.k + self.v)})
        return d

    def shutdown(self) -> None:
        """Drop the sessions and the KV arrays."""
        self.k, self.v = [], []
        self.decoder = self.head = None
