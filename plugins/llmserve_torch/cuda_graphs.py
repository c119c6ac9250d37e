"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, inputs copied into persistent buffers.

A decode step of a small model is hundreds of short kernels; launched one by one from Python the launches, not
the GPU, set the pace. Each bucket's whole step (embedding, every layer, final norm, LM head) is captured once at
start-up and replayed with one call. A batch is padded up to its bucket: the padding rows read position 0 of
block 0 and write their K/V to a scratch block no request owns, and their logits are dropped. Prompt steps (and
any step with prompt tokens) run eagerly.

Off CUDA (tests on a CPU) nothing is captured: run() calls the same padded forward directly, so the padding and
buffer logic is exercised everywhere.
"""

from __future__ import annotations

import logging
import time

import torch

from llmserve_torch.attention import StepMetadata

log = logging.getLogger("llmserve.torch")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 to 64 and of 32 beyond (padding wastes at most a third, and under 15% past
    64), with max_batch itself last."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 16
    while b < max_batch:
        sizes.append(b)
        b += 16 if b < 64 else 32
    return sizes + [max_batch]


class DecodeGraphs:
    """Persistent step inputs, one captured decode step per bucket, and the copy-in / replay of each step."""

    def __init__(self, model, attention, max_batch: int, max_blocks: int, scratch_slot: int, device: torch.device):
        self.model, self.attention, self.device = model, attention, device
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        B = self.buckets[-1]
        pin = device.type == "cuda"
        # host staging (pinned, so the copies to the device are asynchronous) and the device buffers graphs read
        self.host = {
            "ids": torch.zeros(B, dtype=torch.long, pin_memory=pin),
            "pos": torch.zeros(B, dtype=torch.int32, pin_memory=pin),
            "slots": torch.full((B,), scratch_slot, dtype=torch.long, pin_memory=pin),
            "tables": torch.zeros((B, max_blocks), dtype=torch.int32, pin_memory=pin),
        }
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.dev = {k: torch.zeros_like(v, device=device) for k, v in self.host.items()}
        self.dev["slots"].fill_(scratch_slot)
        self.tok_req = torch.arange(B, dtype=torch.int32, device=device)  # token i is request i
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # the last step's copies out of the pinned buffers: done before they are written again (a step whose
        # requests all skip sampling never waits for the device otherwise)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _step(self, b: int) -> torch.Tensor:
        """The whole decode step of the first b rows of the buffers: float32 logits [b, vocab]."""
        d = self.dev
        meta = StepMetadata(slots=d["slots"][:b], tok_req=self.tok_req[:b], tok_pos=d["pos"][:b],
                            block_tables=d["tables"][:b], q_starts=list(range(b)), q_lens=[1] * b, ctx_lens=[1] * b,
                            num_tokens=b)
        step = self.model.prepare_step(d["pos"][:b].long())
        self.attention.begin_step(meta)
        return self.model.logits(self.model.forward(d["ids"][:b], step, self.attention))

    def capture(self) -> None:
        """Capture every bucket, the largest first so the smaller ones reuse its memory pool."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._step(b)  # compiles the kernels and settles the allocator before capture
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[b] = self._step(b)
                pool = g.pool()
                self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: %d decode batch sizes captured (up to %d) in %.1fs", len(self.buckets),
                 self.buckets[-1], time.perf_counter() - t0)

    def fits(self, n: int) -> bool:
        """Whether a decode batch of n requests is replayed from a graph."""
        return n <= self.buckets[-1]

    def run(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step for n requests (one token each): float32 logits [n, vocab], valid until the next run."""
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        if self._copied is not None:
            self._copied.synchronize()
        h = self.np
        h["ids"][:n] = ids
        h["pos"][:n] = pos
        h["slots"][:n] = slots
        h["ids"][n:b] = 0
        h["pos"][n:b] = 0
        h["slots"][n:b] = self.scratch_slot
        t = h["tables"]
        for i, bt in enumerate(tables):
            t[i, :len(bt)] = bt
        t[n:b] = 0
        for k in ("ids", "pos", "slots"):
            self.dev[k][:b].copy_(self.host[k][:b], non_blocking=True)
        self.dev["tables"][:b].copy_(self.host["tables"][:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        g = self.graphs.get(b)
        if g is None:  # not captured (off CUDA): the same padded step, run directly
            return self._step(b)[:n]
        g.replay()
        return self.outputs[b][:n]


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns a request of max_model_len tokens needs."""
    return -(-max_model_len // block_size)

