"""Batched sampling on the device: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Randomness: a request with a seed draws from a generator seeded by (seed, num_output_tokens), so
the token it gets depends only on its own logits and that pair, never on what else is in the batch
or on preemption. Requests without a seed share the backend's generator (seeded by model.seed).
The token is argmax(probs / E) with E ~ Exp(1) per vocabulary entry (the exponential-race form of
sampling from probs), so sorting for top-k/top-p never changes which random number a token gets.

On CPU, where the kernel library builds, top-k/top-p/min-p and the race run there (csrc/race.cpp):
the filters without sorting the row (torch's sort of a whole row took longer than the model's decode
step), the race in log form, argmax(x / t - log E), E's uniform draws a hash of a 64-bit key and the
vocabulary index: a seeded row's key comes from (seed, num_output_tokens), the others' from the
backend's generator, one draw a row instead of one a vocabulary entry (docs/backend-torch.md, "Sampling").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from llmserve.batch import ScheduledRequest
from llmserve.constraints import unpack_bitmask
from llmserve.request import Logprob, SamplingParams
from llmserve_torch import kernel_library

_MASK = float("-inf")
_M64 = (1 << 64) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit seed from (request seed, output index) (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + (num_output_tokens + 1) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def _needs_processing(sp: SamplingParams, num_output_tokens: int) -> bool:
    return bool(sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty or sp.logit_bias
                or (sp.min_tokens and num_output_tokens < sp.min_tokens))


def _ranks(sp: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p drops anything (top_p decided as float32, the value the kernels see: 1 - 1e-9 is 1.0)."""
    return 0 < sp.top_k < vocab or np.float32(sp.top_p) < 1.0


def _filters(sp: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p drops anything (kernels.h's row_filters)."""
    return _ranks(sp, vocab) or sp.min_p > 0


def apply_logit_processors(logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                           eos_token_ids: Collection[int]) -> None:
    """In place: repetition (prompt+output), presence/frequency (output), logit bias, min_tokens stop masking."""
    V = logits.shape[1]
    dev = logits.device
    for i, r in enumerate(reqs):
        sp = r.sampling
        n_out = r.num_output_tokens
        if not _needs_processing(sp, n_out):
            continue
        row = logits[i]
        toks = r.token_ids[: r.num_prompt_tokens + n_out]
        if sp.repetition_penalty != 1.0 and toks:
            ids = torch.tensor(sorted(set(toks)), dtype=torch.long, device=dev)
            ids = ids[ids < V]
            vals = row.index_select(0, ids)
            row.index_copy_(0, ids, torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty))
        if (sp.presence_penalty or sp.frequency_penalty) and n_out:
            out = torch.tensor(toks[r.num_prompt_tokens:], dtype=torch.long, device=dev)
            counts = torch.bincount(out[out < V], minlength=V)[:V].to(row.dtype)
            row -= counts * sp.frequency_penalty + (counts > 0).to(row.dtype) * sp.presence_penalty
        if sp.logit_bias:
            ids = [int(t) for t in sp.logit_bias if 0 <= int(t) < V]
            if ids:
                idx = torch.tensor(ids, dtype=torch.long, device=dev)
                row.index_add_(0, idx, torch.tensor([float(sp.logit_bias[t]) for t in sp.logit_bias
                                                     if 0 <= int(t) < V], dtype=row.dtype, device=dev))
        if sp.min_tokens and n_out < sp.min_tokens:
            stops = [t for t in sp.stop_token_ids if 0 <= t < V]
            if not sp.ignore_eos:
                stops += [t for t in eos_token_ids if t < V]
            if stops:
                row[torch.tensor(stops, dtype=torch.long, device=dev)] = _MASK


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  need_sort: bool | None = None, need_min_p: bool | None = None) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; x is [R, V] after temperature; returns x. (On CPU the
    kernel library's sampler filters instead, where it builds: csrc/race.cpp's filter_row.)

    need_sort / need_min_p: whether any row filters by rank / by min-p, when the caller knows it without asking
    the device (each question is a sync with the GPU).
    """
    V = x.shape[1]
    if need_sort is None:
        need_sort = bool(((top_k > 0) & (top_k < V)).any()) or bool((top_p < 1.0).any())
    if need_min_p is None:
        need_min_p = bool((min_p > 0).any())
    if need_sort:
        sorted_x, order = _sort_descending(x)
        rank = torch.arange(V, device=x.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, V).clamp(max=V).unsqueeze(1)
        drop = rank >= k
        sorted_x = sorted_x.masked_fill(drop, _MASK)
        probs = sorted_x.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop |= (cum - probs) >= top_p.unsqueeze(1)
        x = x.scatter(1, order, sorted_x.masked_fill(drop, _MASK))
    if need_min_p:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, _MASK)
    return x


def _sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row in descending order, and where each entry came from. On CPU by numpy: several times faster than
    torch's sort there, which took longer than the model's decode step (docs/backend-torch.md, "Sampling")."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True)
    order = torch.from_numpy(np.argsort(-x.numpy(), axis=-1))
    return x.gather(1, order), order


def _uniform(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


# torch.rand draws multiples of 2^-24, so one draw in 2^24 is exactly 0, whose Exp(1) value would be 0: a masked
# token's 0 / 0 = NaN (which argmax picks), and any token's p / 0 = inf. Flooring at finfo.tiny instead made that
# token win whatever its probability (one row in ~110 at a 152k vocabulary). 2^-25 is the middle of the draw's bin.
EXP_FLOOR = 2.0 ** -25


def _exp_noise(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from uniform ones."""
    return (-torch.log1p(-u)).clamp_min_(EXP_FLOOR)  # log1p(-u) is finite since u < 1


def _logprob_entries(lp: torch.Tensor, chosen: torch.Tensor, ns: list[int]) -> list[Logprob]:
    """Logprob of each row's chosen token, its rank, and the row's top-n alternatives."""
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    max_n = max(ns)
    top_v, top_i = lp.topk(max_n, dim=-1) if max_n > 0 else (None, None)
    chosen_l, lp_l, rank_l = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
    tv = top_v.tolist() if top_v is not None else None
    ti = top_i.tolist() if top_i is not None else None
    out = []
    for i, n in enumerate(ns):
        top = list(zip(ti[i][:n], tv[i][:n])) if n > 0 else []
        out.append(Logprob(token_id=chosen_l[i], logprob=lp_l[i], rank=rank_l[i], top=top))
    return out


class Sampler:
    """Turns the last-position logits of the sampling requests into tokens (and logprobs)."""

    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: Collection[int] = ()):
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)  # every one is masked until min_tokens
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded = torch.Generator(device=device)
        # a faster row argmax for raw float32 CPU logits (set by the backend when its kernel library builds)
        self.fast_argmax = None
        # the exponential race in one pass, race(logits, uniforms, temperature) → tokens (set by the backend on a
        # GPU with Triton); used where no row filters by rank or min-p
        self.fast_race = None
        # sampling on CPU in the kernel library, sample(x, temperatures, keys, top_k, top_p, min_p) → tokens
        # (cpu_sample below, csrc/race.cpp: set by the backend where its kernel library builds): the filters
        # without a sort of the row, the race with noise from a key a row, not a uniform draw per vocabulary entry
        self.keyed_sample = None

    def _uniforms(self, sub: list[SamplingParams], reqs: Sequence[ScheduledRequest], s_rows: list[int], V: int,
                  device: torch.device) -> torch.Tensor:
        """One uniform draw per vocabulary entry of each sampled row: seeded rows from (seed, output index), the
        rest from the backend's generator in one call."""
        unseeded = [j for j, sp in enumerate(sub) if sp.seed is None]
        if len(unseeded) == len(sub):  # the common case: no index to copy over
            return _uniform((len(sub), V), self.generator, device)
        u = torch.empty((len(sub), V), dtype=torch.float32, device=device)
        if unseeded:
            u[torch.tensor(unseeded, device=device)] = _uniform((len(unseeded), V), self.generator, device)
        for j, sp in enumerate(sub):
            if sp.seed is not None:
                self._seeded.manual_seed(step_seed(sp.seed, reqs[s_rows[j]].num_output_tokens))
                u[j] = _uniform((V,), self._seeded, device)
        return u

    def race_keys(self, sub: list[SamplingParams], out_index: list[int], forwards: int = 1) -> torch.Tensor:
        """64-bit keys for keyed_sample, [forwards, rows]: each sampled row's for its next `forwards` tokens, a seeded
        row's from (seed, output index), the rest drawn from the backend's generator in one call."""
        keys = torch.randint(-(2**63), 2**63 - 1, (forwards, len(sub)), generator=self.generator, dtype=torch.int64)
        for j, sp in enumerate(sub):
            if sp.seed is not None:
                for f in range(forwards):
                    keys[f, j] = step_seed(sp.seed, out_index[j] + f)  # 63 bits: fits an int64
        return keys

    def race_temperatures(self, reqs: Sequence[ScheduledRequest], bitmask: torch.Tensor | None) -> list[float] | None:
        """Each row's temperature where every row's token is a greedy argmax or a draw by the keyed race from its
        own logits (top-k/top-p/min-p too: race_filters; no logprobs, logit processing or constraint mask): 0 for a
        greedy row. None where a row needs more (the sampler then takes the logits), or the race is not built
        here."""
        if bitmask is not None or self.keyed_sample is None:
            return None
        temps = []
        for r in reqs:
            sp = r.sampling
            if sp.logprobs is not None or _needs_processing(sp, r.num_output_tokens):
                return None
            temps.append(sp.temperature)
        return temps

    @staticmethod
    def race_filters(reqs: Sequence[ScheduledRequest], vocab: int) -> np.ndarray | None:
        """The drawn rows' top_k, top_p and min_p as float32 [3, rows] (a greedy row's: none) for the keyed race, or
        None where no drawn row filters. A top_k of the vocabulary or more is none (0): as a float32 a top_k near
        2^31 would not fit the int the kernel reads."""
        drawn = [r.sampling if r.sampling.temperature > 0.0 else None for r in reqs]
        if not any(sp is not None and _filters(sp, vocab) for sp in drawn):
            return None
        return np.array([(sp.top_k if 0 < sp.top_k < vocab else 0, sp.top_p, sp.min_p) if sp is not None else
                         (0, 1.0, 0.0) for sp in drawn], dtype=np.float32).T.copy()  # [3, rows], C-contiguous

    def _draw(self, rows: torch.Tensor, reqs: Sequence[ScheduledRequest], s_rows: list[int]) -> torch.Tensor:
        """The tokens of the sampled rows (rows: their logits, reqs[s_rows[j]] row j's request): temperature,
        top-k/top-p/min-p, then the exponential race."""
        sub = [reqs[i].sampling for i in s_rows]
        V = rows.shape[1]
        # the rows' parameters go to the device in one copy; what they ask for is known here, without a sync
        params = torch.tensor([[sp.temperature for sp in sub], [max(sp.top_k, 0) for sp in sub],
                               [sp.top_p for sp in sub], [sp.min_p for sp in sub]], dtype=torch.float64)
        temp, top_k, top_p, min_p = params.to(rows.device, non_blocking=True)
        temp = temp.float()
        if self.keyed_sample is not None and rows.device.type == "cpu":  # the filters too, in the kernel
            keys = self.race_keys(sub, [reqs[i].num_output_tokens for i in s_rows])[0]
            return self.keyed_sample(rows.contiguous(), temp, keys, top_k, top_p, min_p)
        need_sort = any(_ranks(sp, V) for sp in sub)
        need_min_p = any(sp.min_p > 0 for sp in sub)
        u = self._uniforms(sub, reqs, s_rows, V, rows.device)
        if self.fast_race is not None and not need_sort and not need_min_p:
            return self.fast_race(rows, u, temp)
        x = filter_logits(rows / temp.unsqueeze(1), top_k.long(), top_p.float(), min_p.float(), need_sort=need_sort,
                          need_min_p=need_min_p)
        return (x.softmax(dim=-1) / _exp_noise(u)).argmax(dim=-1)

    def sample(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest], bitmask: torch.Tensor | None = None,
               bitmask_rows: Sequence[int] = ()) -> tuple[list[int], list[Logprob | None]]:
        """logits: float32 [R, V], one row per request; bitmask[k] limits row bitmask_rows[k] (constraints.py).

        Returns one token per row and optional logprobs.
        """
        R = logits.shape[0]
        want_lp = [r.sampling.logprobs for r in reqs]
        raw_lp = None
        if any(n is not None for n in want_lp):
            raw_lp = torch.log_softmax(logits, dim=-1)  # the model's own distribution, before any processing
        processed = any(_needs_processing(r.sampling, r.num_output_tokens) for r in reqs)
        if processed:
            logits = logits.clone()
            apply_logit_processors(logits, reqs, self.eos_token_ids)
        if bitmask is not None:  # one tensor operation for every constrained row
            allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
            if len(bitmask_rows) == R:  # where() writes a new tensor: cheaper than clone + masked_fill
                logits = torch.where(allowed, logits, _MASK)
            else:
                logits = logits if processed else logits.clone()
                idx = torch.tensor(list(bitmask_rows), dtype=torch.long, device=logits.device)
                logits[idx] = torch.where(allowed, logits[idx], _MASK)
            processed = True
        greedy = [r.sampling.temperature == 0.0 for r in reqs]
        tokens = torch.empty(R, dtype=torch.long, device=logits.device)
        g_rows = [i for i in range(R) if greedy[i]]
        s_rows = [i for i in range(R) if not greedy[i]]
        if len(g_rows) == R:
            fast = (self.fast_argmax is not None and not processed and logits.device.type == "cpu"
                    and logits.dtype == torch.float32 and logits.stride(1) == 1)
            tokens = self.fast_argmax(logits) if fast else logits.argmax(dim=-1)
        elif g_rows:
            gi = torch.tensor(g_rows, device=logits.device)
            tokens[gi] = logits.index_select(0, gi).argmax(dim=-1)
        if s_rows:
            si = torch.tensor(s_rows, device=logits.device)
            tokens[si] = self._draw(logits if len(s_rows) == R else logits.index_select(0, si), reqs, s_rows)
        token_list = tokens.tolist()
        lps: list[Logprob | None] = [None] * R
        if raw_lp is not None:
            rows = [i for i in range(R) if want_lp[i] is not None]
            ri = torch.tensor(rows, device=logits.device)
            entries = _logprob_entries(raw_lp.index_select(0, ri), tokens.index_select(0, ri),
                                       [want_lp[i] for i in rows])
            for i, e in zip(rows, entries):
                lps[i] = e
        return token_list, lps


def prompt_logprobs(logits: torch.Tensor, targets: list[int | None], n: int) -> list[Logprob | None]:
    """Logprob of the next prompt token at each position of a chunk (None where there is none)."""
    out: list[Logprob | None] = [None] * len(targets)
    rows = [i for i, t in enumerate(targets) if t is not None]
    if not rows:
        return out
    ri = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, ri), dim=-1)
    chosen = torch.tensor([targets[i] for i in rows], dtype=torch.long, device=logits.device)
    for i, e in zip(rows, _logprob_entries(lp, chosen, [n] * len(rows))):
        out[i] = e
    return out


# --- the kernel library's forms (csrc/paged_attention.cpp, csrc/race.cpp) ---------------------------------------

def cpu_argmax():
    """argmax over the rows of a contiguous float32 CPU matrix via the kernel library (None if it cannot build).

    Only for raw model logits (finite): the library is built with -ffast-math.
    """
    try:
        lib = kernel_library.load()
    except RuntimeError:
        return None
    fn = lib.llmserve_argmax_f32

    def argmax(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.long)
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
        return out

    return argmax


def cpu_sample():
    """Sampling over the rows of a float32 CPU matrix via the kernel library (csrc/race.cpp), as
    sample(x, temperatures, keys, top_k=None, top_p=None, min_p=None) → tokens, or None if the library cannot
    build: each row's top-k/top-p/min-p filter (None: none), then the keyed race. x's rows are contiguous; masked
    entries are -inf; one temperature (> 0), key (int64, read as uint64) and filter value a row."""
    try:
        lib = kernel_library.load()
    except RuntimeError:
        return None
    fn = lib.llmserve_sample_f32

    def sample(x: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, top_k: torch.Tensor | None = None,
               top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
        R = x.shape[0]
        top_k = torch.zeros(R, dtype=torch.int32) if top_k is None else top_k.to(torch.int32).contiguous()
        top_p = torch.ones(R) if top_p is None else top_p.float().contiguous()
        min_p = torch.zeros(R) if min_p is None else min_p.float().contiguous()
        temperatures, keys = temperatures.float().contiguous(), keys.contiguous()
        out = torch.empty(R, dtype=torch.long)
        fn(x.data_ptr(), R, x.shape[1], x.stride(0), temperatures.data_ptr(), top_k.data_ptr(), top_p.data_ptr(),
           min_p.data_ptr(), keys.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    return sample
