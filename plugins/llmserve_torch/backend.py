"""TorchBackend: one forward over a flattened mixed batch on the paged KV cache, then sampling."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from llmserve.batch import Forwards, ModelOutput, SchedulerOutput
from llmserve.config import EngineConfig, check_options
from llmserve.errors import ConfigError
from llmserve.interfaces import ModelBackend
from llmserve.pooling import pooled_rows
from llmserve_torch import kernel_library
from llmserve_torch.attention import KERNELS, StepMetadata, make_attention
from llmserve_torch.cuda_graphs import DecodeGraphs, batch_buckets, table_width
from llmserve_torch.footprint import footprint, memory_by_part, release_free_memory
from llmserve_torch.fused import DECODER_OPS
from llmserve_torch.fused_stack import FUSE_LAYERS, FusedStack, Race, build_stack
from llmserve_torch.huge_pages import MODES as HUGE_PAGE_MODES
from llmserve_torch.huge_pages import place_linears, unavailable
from llmserve_torch.kv_cache import KVCache, budget_blocks, bytes_per_block, parse_tokens
from llmserve_torch.loader import load_model
from llmserve_torch.models.family import family_of
from llmserve_torch.plan_tuner import PlanTuner
from llmserve_torch.quant import QuantLinear
from llmserve_torch.sampling import Sampler, cpu_argmax, cpu_sample, prompt_logprobs

log = logging.getLogger("llmserve.torch")
# torch logs its FakeTensor cache counters at INFO when the process exits (e.g. on Ctrl-C): noise to a user
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.WARNING)

OPTIONS = {
    "attention": "auto",  # auto | reference | cpu
    "linear": "auto",  # auto | torch | onednn: pre-pack weights for oneDNN's GEMM on CPU
    # never size the cache beyond what max_num_seqs full-length sequences can use at once
    "cap_kv_blocks": True,
    # quantized linears: auto (measure at load where a dense copy starts to win, or recall and check a plan
    # measured earlier), retime (measure afresh), or the most rows a quantized kernel runs (0: always the dense
    # copy; a large number: never, and no dense copy is kept)
    "quant_rows": "auto",
    # dense float copies of quantized weights our kernels run at any row count (every GGUF type): off (memory first:
    # none, the quantized kernel runs every step) | auto (kept where the plan measures them faster at many rows,
    # e.g. long prefills on a CPU with AVX512_BF16, at the cost of their memory in /stats backend.memory)
    "dense_copies": "off",
    # the elementwise steps of Llama-style layers: auto (fused C kernels on CPU, Triton on CUDA) | torch | cpu | triton
    "decoder_ops": "auto",
    # every layer of a quantized Llama-style model in one C call for steps of a few rows (fused_stack.py): auto | off
    "fuse_layers": "auto",
    # a step with at least this many decodes rounds their rows' activations in the fused layers' quantized kernels to
    # int8 per group of 32 (as llama.cpp does for every row), not int16: half the integer products where many rows
    # make a step compute-bound, a group's small values rounded coarser beside its largest; prompt rows never; 0: never;
    # auto: as many as make the step compute-bound on this build (kernel_library.int8_decode_rows)
    "int8_decode_rows": "auto",
    # the quantized linears' weights in one arena of 2 MiB pages on CPU (huge_pages.py): auto | off
    "huge_pages": "auto",
    # decode steps replayed from CUDA graphs: auto (on CUDA with the triton attention, batches up to
    # max_num_seqs) | off | the largest batch captured (off CUDA the padded step runs uncaptured: for tests)
    "cuda_graphs": "auto",
}


def _table(r, tokens: int, block_size: int) -> list[int]:
    """The blocks of r's block table that hold its first `tokens` tokens (an error if the table is short)."""
    nb = -(-tokens // block_size)
    if nb > len(r.block_table):
        raise RuntimeError(f"request {r.request_id}: block table holds {len(r.block_table)} blocks, "
                           f"{tokens} tokens need {nb}")
    return r.block_table[:nb]


def _leading_decodes(batch: SchedulerOutput) -> int:
    """How many of the step's first rows are decodes (one token each, past the prompt): a batch lists them first."""
    n = 0
    for r in batch.requests:
        if r.num_new_tokens != 1 or r.num_computed_tokens < r.num_prompt_tokens:
            break
        n += 1
    return n


class ForwardResult(NamedTuple):
    """What TorchBackend._forward made of a step: its metadata and rows to sample, and whichever of hidden states,
    logits and tokens the path it took made (None for the others)."""

    meta: StepMetadata
    sample_rows: list[int]  # the flattened rows whose logits sample (each sampling sequence's last)
    hidden: torch.Tensor | None = None  # [T, hidden] before the final norm; None where forwards ran ahead
    logits: torch.Tensor | None = None  # every row's float32 logits, where the fused call made them
    tokens: list[int] | None = None  # every row's token, where the fused call chose them (greedy or the race's)
    more: list[list[int]] | None = None  # the later forwards' tokens where several ran (ModelOutput.more_token_ids)

class TorchBackend(ModelBackend):
    """The registered model families (models/family.py) in plain PyTorch on a backend-owned paged KV cache."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.options = check_options(config.backend.options, OPTIONS, "backend.options (torch backend)")
        if self.options["attention"] not in KERNELS:
            raise ConfigError(f"backend.options.attention: must be one of {', '.join(KERNELS)}, "
                              f"got {self.options['attention']!r}")
        mc = config.model
        if self.options["decoder_ops"] not in DECODER_OPS:
            raise ConfigError(f"backend.options.decoder_ops: must be one of {', '.join(DECODER_OPS)}, "
                              f"got {self.options['decoder_ops']!r}")
        quant_rows = self.options["quant_rows"]
        if quant_rows not in ("auto", "retime") and (isinstance(quant_rows, bool) or not isinstance(quant_rows, int)
                                                     or quant_rows < 0):
            raise ConfigError(f"backend.options.quant_rows: must be auto, retime or a number of rows >= 0, "
                              f"got {quant_rows!r}")
        rows = self.options["int8_decode_rows"]
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ConfigError(f"backend.options.int8_decode_rows: must be auto or a number of rows >= 0 (0: never), "
                              f"got {rows!r}")
        if self.options["dense_copies"] not in ("off", "auto", False):  # (YAML reads a bare off as false)
            raise ConfigError(f"backend.options.dense_copies: must be off or auto, got {self.options['dense_copies']!r}")
        for key in ("fuse_layers", "huge_pages", "cuda_graphs"):  # YAML reads a bare off / on as false / true
            if isinstance(self.options[key], bool):
                self.options[key] = "auto" if self.options[key] else "off"
        for key, allowed in (("fuse_layers", FUSE_LAYERS), ("huge_pages", HUGE_PAGE_MODES)):
            if self.options[key] not in allowed:
                raise ConfigError(f"backend.options.{key}: must be one of {', '.join(allowed)}, "
                                  f"got {self.options[key]!r}")
        graphs = self.options["cuda_graphs"]
        if graphs not in ("auto", "off") and (isinstance(graphs, bool) or not isinstance(graphs, int) or graphs < 1):
            raise ConfigError(f"backend.options.cuda_graphs: must be auto, off or the largest batch to capture "
                              f"(>= 1), got {graphs!r}")
        sc = config.scheduler
        loaded = load_model(mc, linear=self.options["linear"], batch_hint=sc.max_num_seqs,
                            max_batch_rows=max(sc.max_num_batched_tokens, sc.max_num_seqs), quant_rows=quant_rows,
                            ops=self.options["decoder_ops"], dense_copies=self.options["dense_copies"])
        self.loaded = loaded
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.dtype = loaded.dtype
        # bytes and multiply-accumulates of a decode step, for the limit `bench offline` prints
        self.footprint = footprint(self.model, self.arch, self.dtype)
        self.huge_pages, self.huge_pages_note = self._place_weights()
        release_free_memory()  # the load's temporaries, freed but still resident
        self.vocab_size = self.arch.vocab_size
        # embeddings pool the final-norm hidden states (llmserve/pooling.py): as the family says (a decoder's last
        # token); an encoder (bidirectional, whole prompts, no K/V kept) serves nothing else
        self.family = family_of(self.arch)
        self.hidden_size = self.arch.hidden_size
        self.pooling = self.family.default_pooling(self.loaded.source)
        self.generates, self.causal = self.family.generates, self.family.causal
        limit = self.arch.max_position_embeddings
        if mc.max_model_len is not None:
            if self.arch.context_bound and mc.max_model_len > limit:
                raise ConfigError(f"model.max_model_len: {mc.max_model_len} exceeds {self.arch.context_bound} "
                                  f"({limit})")
            limit = mc.max_model_len
        self.max_model_len = limit
        self.eos_token_id = self.arch.eos_token_id
        self.eos_token_ids = loaded.generation.eos_token_ids | {self.eos_token_id} - {None}
        self.generation_defaults = loaded.generation.sampling
        self.generation_defaults_source = loaded.generation.source
        # the embedded model's vocabulary is the byte-level tokenizer's, each byte shown as a printable character
        # (its random output would otherwise send control bytes to a terminal); a checkpoint ships its own
        self.default_tokenizer = "printable" if mc.model == "embedded" else "hf"
        # a GGUF carries its tokenizer in metadata: its source saved it as files next to the converted weights
        self.tokenizer_path = loaded.tokenizer_dir
        self.sampler = Sampler(self.device, seed=mc.seed, eos_token_ids=self.eos_token_ids)
        self.kv: KVCache | None = None
        self.block_size = 0  # the KV blocks' tokens (init_kv_cache)
        self.attention = None
        self.graphs: DecodeGraphs | None = None
        self.stack: FusedStack | None = None
        self.stack_note = "no KV cache yet"
        self._last_step = time.monotonic()  # the plan tuner times deferred kernel plans once steps pause
        self.tuner: PlanTuner | None = None
        # held by every step and by the tuner while it times: our kernels' thread team runs one call at a time
        self._step_lock = threading.Lock()
        self._kv_peak = {"reserved_slots": 0, "used_slots": 0}
        self._steps = 0

    def _place_weights(self):
        """backend.options.huge_pages: the quantized linears' weights in one huge-page arena, or why not (None)."""
        if self.options["huge_pages"] == "off":
            return None, "off"
        why = "the weights are not on the CPU" if self.device.type != "cpu" else unavailable()
        if why:
            return None, why
        try:  # (the mapping is made before any tensor moves: a failure leaves torch's tensors in place)
            arena = place_linears([lin for lin in self.model.linears() if isinstance(lin, QuantLinear)])
        except OSError as e:
            log.warning("quantized weights stay in torch's tensors: the huge-page mapping failed: %s", e)
            return None, f"the huge-page mapping failed: {e}"
        if arena is None:
            return None, "no quantized linears"
        log.info("quantized weights: %.1f MiB in huge pages (%.1f MiB granted)", arena.used / 2**20,
                 arena.granted / 2**20)
        return arena, "on"

    # --- KV cache -----------------------------------------------------------------------------

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks the kv_cache_memory budget holds, capped at what max_num_seqs full sequences can use."""
        per_block = bytes_per_block(self.arch, block_size, self.dtype)
        if not self.causal:  # an encoder keeps no K/V: the blocks only count each sequence's tokens
            return -(-self.max_model_len // block_size) * self.config.scheduler.max_num_seqs + 1
        value = self.config.backend.kv_cache_memory
        reserve = 0 if parse_tokens(value) is not None else self._forward_peak_bytes()
        n = budget_blocks(value, block_size, per_block, self.device, reserve)
        if self.options["cap_kv_blocks"]:
            per_seq = -(-self.max_model_len // block_size)
            n = min(n, per_seq * self.config.scheduler.max_num_seqs + 1)
        if n < 1:
            raise ConfigError(f"backend.kv_cache_memory: {value!r} holds no KV block "
                              f"(one block of {block_size} tokens takes {per_block} bytes)")
        return int(n)

    def _forward_peak_bytes(self) -> int:
        """On CUDA, what the largest step's forward allocates beyond the weights, measured by running one of
        max_num_batched_tokens prompt tokens on a cache of its own (vLLM's profiling run); elsewhere 0."""
        if self.device.type != "cuda":
            return 0
        sc, bs = self.config.scheduler, 16
        T = max(1, sc.max_num_batched_tokens)
        L = self.max_model_len  # the step's tokens as requests of at most L tokens each, on blocks of their own
        lens = [min(L, T - s) for s in range(0, T, L)]
        per = -(-min(L, T) // bs)
        kv = KVCache(self.arch, per * len(lens), bs, self.dtype, self.device)
        attention = make_attention(self.options["attention"], self.arch, kv)
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        with torch.inference_mode():
            req = np.repeat(np.arange(len(lens)), lens)
            p = np.concatenate([np.arange(n) for n in lens])
            pos = torch.from_numpy(p.astype(np.int32)).to(dev)
            tables = np.arange(per * len(lens), dtype=np.int32).reshape(len(lens), per)
            meta = StepMetadata(slots=torch.from_numpy(tables[req, p // bs].astype(np.int64) * bs + p % bs).to(dev),
                                tok_req=torch.from_numpy(req.astype(np.int32)).to(dev), tok_pos=pos,
                                block_tables=torch.from_numpy(tables).to(dev),
                                q_starts=[sum(lens[:i]) for i in range(len(lens))], q_lens=lens, ctx_lens=lens,
                                num_tokens=T)
            attention.begin_step(meta)
            hidden = self.model.forward(torch.zeros(T, dtype=torch.long, device=dev),
                                        self.model.prepare_step(pos.long()), attention)
            self.model.logits(hidden[-min(T, sc.max_num_seqs):])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del kv, attention, hidden, meta
        torch.cuda.empty_cache()
        # each decode graph keeps its float32 logits [bucket, vocab] alive in the graphs' pool
        most = self._graphs_wanted()
        graphs = sum(batch_buckets(most)) * self.arch.vocab_size * 4 if most else 0
        log.info("profiling forward of %d tokens: %.0f MiB of activations (+ %.0f MiB for the decode graphs' logits)",
                 T, peak / 2**20, graphs / 2**20)
        return peak + graphs

    def _graphs_wanted(self) -> int:
        """The largest decode batch to replay from a CUDA graph (0: none)."""
        opt = self.options["cuda_graphs"]
        if opt == "off":
            return 0
        if opt == "auto":
            return self.config.scheduler.max_num_seqs if self.device.type == "cuda" else 0
        return opt

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the K/V tensors, pick the attention kernel for them, capture the decode graphs (CUDA)."""
        self.block_size = block_size
        if not self.causal:
            self.attention, self.stack_note = self.family.own_attention(self.arch), "an encoder"
            log.info("no KV cache: an encoder attends within each prompt, computed whole in one step")
            return
        max_graph_batch = self._graphs_wanted()
        self.kv = KVCache(self.arch, num_blocks, block_size, self.dtype, self.device, scratch=max_graph_batch > 0)
        self.attention = make_attention(self.options["attention"], self.arch, self.kv)
        if self.attention.name == "cpu":
            self.sampler.fast_argmax = cpu_argmax()
            self.sampler.keyed_sample = cpu_sample()
            sc = self.config.scheduler
            self.stack, self.stack_note = build_stack(self.options["fuse_layers"], self.model, self.attention,
                                                      kernel_library.load(), max(sc.max_num_batched_tokens, sc.max_num_seqs))
            if self.stack is not None:  # greedy tokens fed back inside the one call
                lib, rows = kernel_library.load(), self.options["int8_decode_rows"]
                self.stack.int8_rows = rows = kernel_library.int8_decode_rows(lib) if rows == "auto" else rows
                amx = kernel_library.amx(lib)
                tiles = kernel_library.AMX_MIN_ROWS
                amx = amx and tiles <= self.stack.max_rows
                if self.dtype == torch.bfloat16 and amx:  # bf16 activations: every call of many rows on the tiles
                    self.stack_note += (f"; steps of {tiles}+ rows (prompts too) in bf16 on AMX tiles, the weights "
                                        "dequantized as they are read")
                    if 0 < rows < tiles:
                        self.stack_note += f"; int8 activations in smaller steps of {rows}+ decodes"
                elif 0 < rows <= self.stack.max_rows:
                    self.stack_note += ("; int8 activations in every decode" if rows == 1 else
                                        f"; int8 activations in batches of {rows}+ decodes")
                    if amx:
                        self.stack_note += (f" ({max(rows, tiles)}+: bf16 on AMX tiles, "
                                            "the weights dequantized as they are read)")
                self.forwards = Forwards(self.stack.max_forwards, self.stack.head_rows)  # (decode_ahead's rows)
            plan = self.loaded.kernels
            if plan is not None and plan.pending and self.tuner is None:
                self._last_step = time.monotonic()  # (the engine's warm-up step comes first)
                self.tuner = PlanTuner(plan, lambda: time.monotonic() - self._last_step, self._step_lock)
                self.tuner.start()
        else:
            self.stack, self.stack_note = None, "it runs with the cpu attention kernel"
        if self.attention.name == "triton":  # Triton runs here: sample in one pass over the logits too
            from llmserve_torch.triton_kernels import race_argmax

            self.sampler.fast_race = race_argmax
        m = memory_by_part(self.model, self.kv)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB, kv_cache_memory %s), attention kernel %s; memory: "
                 "quantized weights %.0f MiB, dense copies %.0f MiB, dense linears %.0f MiB, embedding %.0f MiB, "
                 "resident now %.0f MiB", num_blocks, block_size, self.kv.nbytes / 2**20,
                 self.config.backend.kv_cache_memory, self.attention.name, m["quantized_weights"] / 2**20,
                 m["dense_copies"] / 2**20, m["dense_linears"] / 2**20, m["embedding"] / 2**20, (m["rss"] or 0) / 2**20)
        if max_graph_batch:
            if self.attention.name != "triton":  # the graphs read every step input from device buffers
                if self.options["cuda_graphs"] != "auto":
                    raise ConfigError("backend.options.cuda_graphs: needs the triton attention kernel, not "
                                      f"{self.attention.name}")
                return
            self.graphs = DecodeGraphs(self.model, self.attention, max_graph_batch,
                                       table_width(self.max_model_len, block_size), self.kv.scratch_slot, self.device)
            self.graphs.capture()

    # --- one step -------------------------------------------------------------------------------

    def _metadata(self, batch: SchedulerOutput, lookahead: int = 0):
        """Flatten the batch: token ids, positions, slots, block tables (each `lookahead` tokens past the step's
        context: later forwards of a step), rows to compute logits for."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tok_req: list[int] = []
        q_starts, q_lens, ctx_lens, tables = [], [], [], []
        sample_rows: list[int] = []
        reserved = used = 0
        for ri, r in enumerate(batch.requests):
            s, n = r.num_computed_tokens, r.num_new_tokens
            ctx = s + n
            bt = r.block_table
            table = _table(r, ctx + lookahead, bs)
            nb = len(table)
            q_starts.append(len(ids))
            q_lens.append(n)
            ctx_lens.append(ctx)
            tables.append(table)
            ids.extend(r.token_ids[s:ctx])
            if n == 1:
                pos.append(s)
                slots.append(bt[s // bs] * bs + s % bs)
            else:  # a prompt chunk: its slots in a few array operations (a 16k-token step took 3.7 ms in Python)
                pos.extend(range(s, ctx))
                p = np.arange(s, ctx)
                slots.extend(((np.asarray(bt[:nb]) * bs)[p // bs] + p % bs).tolist())
            tok_req.extend([ri] * n)
            if r.do_sample:
                sample_rows.append(len(ids) - 1)
            reserved += len(bt) * bs
            used += ctx
        self._note_kv_use(reserved, used)
        maxb = max(len(t) for t in tables)
        flat: list[int] = []
        for t in tables:
            flat.extend(t)
            flat.extend([0] * (maxb - len(t)))
        dev = self.device

        def tensor(values: list[int], dtype) -> torch.Tensor:  # through numpy: 3x faster than torch.tensor(list)
            t = torch.from_numpy(np.array(values, dtype=dtype))
            return t if dev.type == "cpu" else t.to(dev, non_blocking=True)  # (a no-op .to still costs ~3 us)

        meta = StepMetadata(
            slots=tensor(slots, np.int64), tok_req=tensor(tok_req, np.int32), tok_pos=tensor(pos, np.int32),
            block_tables=tensor(flat, np.int32).view(len(tables), maxb),
            q_starts=q_starts, q_lens=q_lens, ctx_lens=ctx_lens, num_tokens=len(ids),
        )
        return tensor(ids, np.int64), meta, sample_rows

    def _note_kv_use(self, reserved: int, used: int) -> None:
        """Remember the step that reserved the most KV slots (kv_peak)."""
        if reserved > self._kv_peak["reserved_slots"]:
            self._kv_peak = {"reserved_slots": reserved, "used_slots": used}

    def _forward(self, batch: SchedulerOutput, temps: list[float] | None = None) -> ForwardResult:
        """Metadata once per step, then the model over every flattened token (ForwardResult says what comes back).
        Given `temps` (Sampler.race_temperatures: 0 greedy, else the keyed race's), the fused layers choose every
        row's token where every row samples, and run a batch of decodes offered several forwards (Forwards) all in
        one call where they can."""
        ids, meta, sample_rows = self._metadata(batch, batch.num_steps - 1 if temps is not None else 0)
        T = meta.num_tokens
        if self.stack is not None and self.stack.covers(T):
            head = len(sample_rows) == T and self.stack.covers_head(T)
            if head and temps is not None and batch.num_steps > 1 and T == len(batch.requests):  # forwards ahead
                tokens = self.stack.decode_ahead(ids, meta, batch.num_steps, self._race(batch, temps, batch.num_steps),
                                                 self.on_forward)
                return ForwardResult(meta, sample_rows, tokens=tokens[0], more=tokens[1:])
            race = self._race(batch, temps, 1) if head and temps is not None else None
            hidden, logits, tokens = self.stack.forward(ids, meta, logits=head, argmax=temps is not None, race=race,
                                                        decodes=_leading_decodes(batch))
            return ForwardResult(meta, sample_rows, hidden, logits, tokens)
        self.attention.begin_step(meta)
        return ForwardResult(meta, sample_rows,
                             self.model.forward(ids, self.model.prepare_step(meta.tok_pos.long()), self.attention))

    def _race(self, batch: SchedulerOutput, temps: list[float], forwards: int) -> Race | None:
        """The fused call's drawn rows (every row of `batch` samples, temps one each): None where all are greedy."""
        if not any(temps):
            return None
        reqs = batch.requests
        keys = self.sampler.race_keys([r.sampling for r in reqs], [r.num_output_tokens for r in reqs], forwards)
        return Race(np.asarray(temps, dtype=np.float32), keys.numpy(), self.sampler.race_filters(reqs, self.vocab_size))

    def _graph_step(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits of every request of a decode-only step replayed from a CUDA graph, or None where the step runs
        eagerly (prompt tokens, prompt logprobs asked for, a batch past the largest graph, no graphs)."""
        g = self.graphs
        reqs = batch.requests
        if g is None or not g.fits(len(reqs)) or any(r.num_new_tokens != 1 or r.sampling.prompt_logprobs is not None
                                                      or r.pooling is not None for r in reqs):
            return None
        bs = self.kv.block_size
        pos = [r.num_computed_tokens for r in reqs]
        tables = [_table(r, p + 1, bs) for r, p in zip(reqs, pos)]
        slots = [t[-1] * bs + p % bs for t, p in zip(tables, pos)]
        self._note_kv_use(bs * sum(len(r.block_table) for r in reqs), sum(pos) + len(reqs))
        return g.run([r.token_ids[p] for r, p in zip(reqs, pos)], pos, slots, tables)

    def compute_logits(self, batch: SchedulerOutput) -> torch.Tensor:
        """Float32 logits of every token the batch computes, [T, vocab] (for tests and debugging; writes K/V)."""
        if self.kv is None:
            raise RuntimeError("init_kv_cache() must be called before compute_logits()")
        with torch.inference_mode():
            hidden = self._forward(batch).hidden
            return self.model.logits(hidden)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Copy-on-write blocks, run the forward, sample the requests that want a token."""
        with self._step_lock:  # (a kernel plan timing in the background waits, or is waited for)
            return self._execute(batch)

    def _execute(self, batch: SchedulerOutput) -> ModelOutput:
        if self.attention is None:
            raise RuntimeError("init_kv_cache() must be called before execute()")
        reqs = batch.requests
        if not reqs:
            return ModelOutput(sampled_token_ids=[])
        self._last_step = time.monotonic()
        with torch.inference_mode():
            graphed = self._graph_step(batch)
            sample_reqs = [r for r in reqs if r.do_sample]
            logits = tokens = more = None
            if graphed is None:
                temps = self.sampler.race_temperatures(sample_reqs, batch.token_bitmask)
                meta, sample_rows, hidden, logits, tokens, more = self._forward(batch, temps)
            # (before anything else runs: the fused call's hidden states are its buffers)
            pooled = self._pooled(batch, hidden, meta) if graphed is None and any(r.pooling for r in reqs) else None
            sampled: list[int | None] = [None] * len(reqs)
            logprobs = None
            if sample_reqs:
                if graphed is not None:  # logits of every row; a one-token prompt chunk may not sample
                    logits = graphed if len(sample_reqs) == len(reqs) else graphed[
                        torch.tensor([i for i, r in enumerate(reqs) if r.do_sample], device=self.device)]
                elif logits is None and tokens is None:  # (the fused call makes them where every row samples)
                    if len(sample_rows) == hidden.shape[0]:  # every row samples (decodes): no gather
                        logits = self.model.logits(hidden)
                    else:
                        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
                        logits = self.model.logits(hidden.index_select(0, rows))
                if tokens is not None:  # and its tokens: the sampler would take the same argmax, or race
                    toks, lps = tokens, [None] * len(tokens)
                else:
                    mask_rows = ()
                    if batch.token_bitmask is not None:  # the mask's rows index reqs; the sampler's, sample_reqs
                        pos = {i: j for j, i in enumerate(i for i, r in enumerate(reqs) if r.do_sample)}
                        mask_rows = [pos[i] for i in batch.bitmask_rows]
                    toks, lps = self.sampler.sample(logits, sample_reqs, batch.token_bitmask, mask_rows)
                it = iter(zip(toks, lps))
                if any(lp is not None for lp in lps):
                    logprobs = [None] * len(reqs)
                for i, r in enumerate(reqs):
                    if r.do_sample:
                        tok, lp = next(it)
                        sampled[i] = tok
                        if logprobs is not None:
                            logprobs[i] = lp
            plp = None
            if any(r.sampling.prompt_logprobs is not None for r in reqs):
                plp = [None] * len(reqs)
                for i, r in enumerate(reqs):
                    if r.sampling.prompt_logprobs is None:
                        continue
                    s, n = r.num_computed_tokens, r.num_new_tokens
                    targets = [r.token_ids[p + 1] if p + 1 < r.num_prompt_tokens else None for p in range(s, s + n)]
                    if all(t is None for t in targets):
                        plp[i] = [None] * n
                        continue
                    qs = meta.q_starts[i]
                    lg = self.model.logits(hidden[qs:qs + n])
                    plp[i] = prompt_logprobs(lg, targets, r.sampling.prompt_logprobs)
        self._steps += 1
        return ModelOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=plp, more_token_ids=more,
                           pooled=pooled)

    def _pooled(self, batch: SchedulerOutput, hidden: torch.Tensor, meta) -> list[list[float] | None]:
        """Each pooling sequence's sum of its chunk's pooled rows' final-norm hidden states, in float32 (None for
        the others, and where the chunk has no such row)."""
        out: list[list[float] | None] = []
        for i, r in enumerate(batch.requests):
            rows = pooled_rows(r.pooling, r.num_computed_tokens, r.num_new_tokens, r.num_prompt_tokens) \
                if r.pooling is not None else range(0)
            if not rows:
                out.append(None)
                continue
            qs = meta.q_starts[i]
            out.append(self.model.final_hidden(hidden[qs + rows.start:qs + rows.stop]).float().sum(0).tolist())
        return out

    # --- reporting ------------------------------------------------------------------------------

    def kv_peak(self) -> dict[str, Any]:
        """Reserved vs used KV slots at the step that reserved the most."""
        p = dict(self._kv_peak)
        p["waste_fraction"] = 1 - p["used_slots"] / p["reserved_slots"] if p["reserved_slots"] else 0.0
        return p

    def describe(self) -> dict[str, Any]:
        """Model, dtype, device, kernel, weights, cache size, threads, and what a decode step reads (footprint.py)."""
        a = self.arch
        d = {
            "backend": "torch",
            "model": self.loaded.source,
            "model_type": a.model_type,
            "layers": a.num_layers, "hidden_size": a.hidden_size, "heads": a.num_heads, "kv_heads": a.num_kv_heads,
            "vocab_size": a.vocab_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "dtype_reason": self.loaded.dtype_reason,
            "device": str(self.device),
            "weights": self.loaded.weights,
            "linear": self.loaded.linear,
            "quantization": self._quantization(),
            "decoder_ops": self.model.ops.name if self.model.ops is not None else "torch",
            # which build of the CPU kernels runs, or why none does and what that costs
            "kernel_library": kernel_library.describe() if self.device.type == "cpu" else None,
            "max_model_len": self.max_model_len,
            "threads": torch.get_num_threads(),
            # (granted: as the kernel backed the arena at load; reading it again costs ~25 ms)
            "huge_pages": ({"weights_bytes": self.huge_pages.used, "granted_bytes": self.huge_pages.granted}
                           if self.huge_pages is not None else self.huge_pages_note),
            "torch": torch.__version__,
            **self.footprint,
        }
        d["memory"] = memory_by_part(self.model, self.kv)
        if self.kv is not None:
            d["kv_cache"] = {"setting": self.config.backend.kv_cache_memory, "tokens": self.kv.num_blocks *
                             self.kv.block_size, "bytes": self.kv.nbytes}
        if self.kv is not None:
            d["cuda_graphs"] = self.graphs.buckets if self.graphs is not None else "off"
            d["fused_layers"] = self.stack_note
            d.update({"attention": self.attention.name, "kv_blocks": self.kv.num_blocks,
                      "kv_block_size": self.kv.block_size, "kv_bytes": self.kv.nbytes, "kv_peak": self.kv_peak()})
        return d

    def _quantization(self) -> dict[str, Any]:
        """The asked mode, how many linears run in each form (and from which source type), per source type the kernel
        and the bits a weight it reads, the kernel plan."""
        from collections import Counter

        linears = list(self.model.linears())
        forms = Counter(f"{lin.kind} ({lin.source})" if isinstance(lin, QuantLinear) else "dense" for lin in linears)
        types: dict[str, dict] = {}
        for lin in (lin for lin in linears if isinstance(lin, QuantLinear)):
            t = types.setdefault(lin.source, {"kind": lin.kind, "kernel": lin.kernel, "linears": 0, "bytes": 0,
                                              "params": 0})
            t["linears"] += 1
            t["bytes"] += lin.nbytes
            t["params"] += lin.params
        for t in types.values():
            t["bits_read"] = round(8 * t.pop("bytes") / t.pop("params"), 3)
        return {"mode": self.config.model.quantization, "linears": dict(forms), "types": dict(sorted(types.items())),
                "kernels": self.loaded.kernels.describe() if self.loaded.kernels else {}}

    def shutdown(self) -> None:
        """Drop the weights and the KV tensors."""
        if self.tuner is not None:
            self.tuner.stop()
        self.kv = None
        self.attention = None
        self.graphs = None
        self.stack = None  # it holds the model and the cache too
        self.model = None
