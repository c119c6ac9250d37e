"""All layers of a quantized Llama-style model (models/decoder.py) in one C call for steps of a few rows
(csrc/decode_layers.cpp).

At one sequence a decode step of the default model is ~400 short kernel calls, and the Python, ctypes and
allocation around each cost about as much as the kernel. The C side runs the same kernels in the same order on
the same values, so hidden states equal the Python path's exactly (tests/torch/test_fused_stack.py); a step
it does not cover (more rows than the quantized kernels take, a model or cache it does not fit) runs in Python.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from llmserve_torch import kernel_library
from llmserve_torch.forward_relay import ForwardRelay, Listener
from llmserve_torch.fused import CpuOps
from llmserve_torch.models.family import family_of
from llmserve_torch.quant import OWN_INT8_MAX_ROWS, QuantLinear
from llmserve_torch.quant_embedding import QuantEmbedding

FUSE_LAYERS = ("auto", "off")
# the most of its share of the next matmul's weights a member asks for while it waits at a barrier (csrc/team.h's
# WaitAhead: a wait is ~25-650 ns, so this only bounds it; 32 KiB read 0.96-1.00 of the time, 256 KiB 0.96-0.99)
WAIT_AHEAD = 256 << 10
# the most forwards one call runs (decode_ahead): scheduler.num_scheduler_steps is the real limit, this sizes the
# token buffer
MAX_FORWARDS = 64


# the call's tables as csrc/llmserve.h lays them out
_api = kernel_library.api()
_QLinear, _Layer, _Model = _api.structs["qlinear"], _api.structs["layer"], _api.structs["model"]
_Scratch, _Step = _api.structs["scratch"], _api.structs["step"]
INT8_ROWS = _api.limits["KIND_INT8_ROWS"]  # _QLinear.kind of int8 per row; a group kind's is its format code


# what the C call can time a step's layers by (its enum Stage, in order): FusedStack.stage_us
STAGES = ("q|k|v matmul", "RoPE + K/V store", "attention", "o matmul", "residual add + RMSNorm", "gate|up matmul",
          "SiLU·up", "down matmul", "final norm + LM head")


def _why_not(model, attention, lib) -> str | None:
    """Why the fused stack cannot run this model on this cache (None when it can)."""
    if lib is None:
        return "the kernel library did not build"
    why = family_of(model.arch).fused_stack(model.arch)  # (a family that runs here builds a DecoderModel)
    if why is not None:
        return why
    if not isinstance(model.ops, CpuOps) or attention.name != "cpu":
        return "it needs the cpu decoder ops and the cpu attention kernel"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16, not {model.dtype}"
    if isinstance(model.embed, torch.Tensor) and (model.embed.dtype != model.dtype or not model.embed.is_contiguous()):
        return "it copies embedding rows as they are: the table must be contiguous, in the activations' dtype"
    for lin in (L[k] for L in model.layers for k in ("qkv", "o", "gate_up", "down")):
        if not _ours(lin):
            return "every linear of the layers must be quantized for llmserve's group or int8 kernels"
    return None


def _ours(lin) -> bool:
    """Whether our kernels run this linear in the call: a group format, or int8 per row (up to a few rows)."""
    return isinstance(lin, QuantLinear) and (lin.fmt is not None or lin.own_int8)


class FusedStack:
    """The C tables of one model on one KV cache, grow-only scratch buffers, and the call for a step."""

    def __init__(self, model, attention, lib, max_batch_rows: int):
        self.model, self.attention = model, attention
        a = model.arch
        self._fn = lib.llmserve_decode_layers
        self._keep = []  # tensors the tables point into (bias copies)
        linears = [L[k] for L in model.layers for k in ("qkv", "o", "gate_up", "down")]
        kinds = {lin.kind for lin in linears}
        # the most rows every quantized kernel takes before the plan hands them to the dense copy (if any)
        limits = [lin.max_quantized_rows() for lin in linears]
        # (no dense copy at all: the quantized kernels take any step the scheduler can make)
        self.max_rows = min(limits + [max_batch_rows] + ([OWN_INT8_MAX_ROWS] if "int8" in kinds else []))
        kv = attention.kv
        layers = (_Layer * a.num_layers)()
        for i, L in enumerate(model.layers):
            layers[i] = _Layer(self._linear(L["qkv"]), self._linear(L["o"]), self._linear(L["gate_up"]),
                               self._linear(L["down"]), L["in_norm"].data_ptr(), L["post_norm"].data_ptr(),
                               kv.k[i].data_ptr(), kv.v[i].data_ptr())
        self._layers = layers
        # the LM head in the same call where our kernels run it (a quantized file's, or int4 quantization's int8):
        # the most rows it takes there, 0 where it runs in Python
        head = model.lm_head
        self.head_rows = (min(head.max_quantized_rows(), OWN_INT8_MAX_ROWS if head.kind == "int8" else self.max_rows)
                          if _ours(head) and head.bias is None else 0)
        # the embedding rows are copied (or dequantized) in the call too (a torch embedding was ~25 us of a step's
        # Python)
        embed = model.embed
        quantized = isinstance(embed, QuantEmbedding)
        # forwards one call runs on a batch of decodes (decode_ahead), each on the greedy tokens of the one before:
        # where the head makes them and its every row is a row of the embedding
        self.max_forwards = MAX_FORWARDS if self.head_rows and head.out_features <= embed.shape[0] else 1
        # how the two members share the matmuls out, kept between calls (decode_layers.cpp's Balance: the lead's
        # share, then each member's busy time on a cache line of its own); zero: equal shares at first
        self._balance = torch.zeros(_api.limits["BALANCE_BYTES"] // 8, dtype=torch.float64)  # (on a cache line)
        self._model = _Model(a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                             a.intermediate_size, kv.block_size, model.dtype.itemsize, a.norm_eps, attention.scale,
                             ctypes.addressof(layers), self._linear(head) if self.head_rows else _QLinear(), model.norm.data_ptr(),
                             (embed.packed if quantized else embed).data_ptr(), embed.fmt if quantized else 0,
                             embed.shape[0], self._balance.data_ptr(), WAIT_AHEAD)
        self._widest_int8 = max((lin.out_features for lin in linears if lin.kind == "int8"), default=0)
        # RoPE's cos/sin at every position, in the form the Python path's rows take: the call reads each token's
        # row itself (no per-step gather)
        self._cos, self._sin = model.ops.tables(model.cos, model.sin, model.dtype)
        self._cos_at, self._sin_at = self._cos.data_ptr(), self._sin.data_ptr()
        self._rows = 0
        self._scratch = None
        self._filtered = np.empty((0, 0), dtype=np.float32)  # the head's filtered rows (_race_args)
        # None, or float64 [len(STAGES)] that each call adds its kernels' microseconds to (profiling only: a clock
        # read per kernel)
        self.stage_us: torch.Tensor | None = None
        self._relay: ForwardRelay | None = None  # made at the first call with a listener (decode_ahead)
        # a step with at least this many decodes rounds their rows' activations in the group kernels to int8, not
        # int16 (0: never): half their integer products where many rows make the step compute-bound (backend option
        # int8_decode_rows)
        self.int8_rows = 0

    def _linear(self, lin: QuantLinear) -> _QLinear:
        bias = None
        if lin.bias is not None:
            bias = lin.bias.to(self.model.dtype).contiguous()
            self._keep.append(bias)
        w, scale = lin.kernel_tensors()
        return _QLinear(INT8_ROWS if lin.fmt is None else lin.fmt, lin.out_features, lin.in_features, w.data_ptr(),
                        0 if scale is None else scale.data_ptr(), 0 if bias is None else bias.data_ptr())

    def covers(self, rows: int) -> bool:
        """Whether a step of this many rows runs here."""
        return 0 < rows <= self.max_rows

    def _buffers(self, rows: int) -> None:
        a, dt = self.model.arch, self.model.dtype
        widths = {"h": a.hidden_size, "qkv": a.q_size + 2 * a.kv_size, "attn": a.q_size, "o": a.hidden_size,
                  "gu": 2 * a.intermediate_size, "act": a.intermediate_size, "down": a.hidden_size}
        bufs = {k: torch.empty((rows, w), dtype=dt) for k, w in widths.items()}
        bufs["f32"] = torch.empty((rows, max(self._widest_int8, 1)), dtype=torch.float32)
        # the head's out: 192 KiB a row for a 49k vocabulary, which a fresh tensor each step paid in page faults
        bufs["logits"] = torch.empty((min(rows, self.head_rows), self.model.lm_head.out_features), dtype=torch.float32)
        # [forwards, rows] (decode_ahead); numpy: its slice and tolist cost ~0.1 us, torch's ~1
        self._tokens = np.empty(self.max_forwards * rows, dtype=np.int64)
        self._tokens_at = self._tokens.ctypes.data  # (.ctypes itself costs ~10 us a step)
        bufs["x"] = torch.empty((rows, a.hidden_size), dtype=dt)
        self._bufs = bufs  # kept alive: the struct holds raw pointers
        self._scratch = _Scratch(*(bufs[k].data_ptr() for k, _ in _Scratch._fields_))
        self._rows = rows
        self._views: dict[int, tuple] = {}

    def _outputs(self, rows: int) -> tuple:
        """The hidden-state and logits buffers' first `rows` rows and their addresses (made once per row count:
        slicing and data_ptr each step cost more than the dict)."""
        v = self._views.get(rows)
        if v is None:
            x, lg = self._bufs["x"][:rows], self._bufs["logits"][:rows]
            v = self._views[rows] = (x, x.data_ptr(), lg, lg.data_ptr())
        return v

    def covers_head(self, rows: int) -> bool:
        """Whether a step of this many rows can have its logits made here too (forward's `logits`)."""
        return 0 < rows <= self.head_rows

    def forward(self, input_ids: torch.Tensor, meta, logits: bool = False, argmax: bool = False,
                race: Race | None = None,
                decodes: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """Hidden states before the final norm, [T, hidden], as DecoderModel.forward returns them; with `logits`
        (covers_head) every row's float32 logits as DecoderModel.logits makes them, with `argmax` too each row's
        token: its first largest logit (the sampler's greedy token), or where `race` gives the row a temperature,
        the token the sampler's keyed race draws with its key; else None for each. Hidden states and logits are
        this stack's buffers: valid until its next call. decodes: the leading rows that are each one sequence's next
        token (int8_rows applies to them)."""
        T = input_ids.shape[0]
        x, out = self._call(input_ids, meta, logits, argmax, 1, race, narrow=self._narrow(decodes))
        return x, out if logits else None, self._tokens[:T].tolist() if logits and argmax else None

    def decode_ahead(self, input_ids: torch.Tensor, meta, forwards: int, race: Race | None = None,
                     listener: Listener | None = None) -> list[list[int]]:
        """Forwards of a batch of decodes run back to back in one call, each on the tokens of the one before
        (greedy, or drawn as `race` says) and a position further on (covers_head rows, up to max_forwards; meta's
        block tables reach the last forward's slots): each forward's tokens, each also handed to `listener` (from
        the relay's thread) as soon as it exists, where one is given. Hidden states and logits are the last
        forward's."""
        T = input_ids.shape[0]
        narrow = self._narrow(T)
        if listener is None:
            self._call(input_ids, meta, True, True, forwards, race, narrow=narrow)
        else:
            self._grow(T)
            if self._relay is None:
                self._relay = ForwardRelay()
            self._relay.open(listener, self._tokens[:forwards * T].reshape(forwards, T))
            try:
                self._call(input_ids, meta, True, True, forwards, race, self._relay, narrow)
            finally:
                self._relay.close()
        return self._tokens[:forwards * T].reshape(forwards, T).tolist()

    def _narrow(self, decodes: int) -> int:
        """The leading rows whose activations are rounded to int8 in a step of this many decodes (int8_rows)."""
        return decodes if 0 < self.int8_rows <= decodes else 0

    def _call(self, input_ids: torch.Tensor, meta, logits: bool, argmax: bool, forwards: int,
              race: Race | None = None, relay: ForwardRelay | None = None,
              narrow: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The C call over the step's rows (telling `relay` of each forward's tokens; the group kernels round the
        activations of the first `narrow` rows to int8); its hidden-state and logits buffers."""
        T = input_ids.shape[0]
        self._grow(T)
        x, x_at, out, out_at = self._outputs(T)
        bt = meta.block_tables
        st = _Step(x_at, input_ids.data_ptr(), T, self._cos_at, self._sin_at, meta.slots.data_ptr(), bt.data_ptr(),
                   bt.shape[1], meta.tok_req.data_ptr(), meta.tok_pos.data_ptr(), torch.get_num_threads(),
                   None if self.stage_us is None else self.stage_us.data_ptr(), out_at if logits else None,
                   self._tokens_at if logits and argmax else None, forwards,
                   *(self._race_args(race, T) if race is not None and argmax else (None,) * 4),
                   *((relay.progress_at, relay.notify_fd) if relay is not None else (None, -1)), narrow)
        if self._fn(ctypes.addressof(self._model), ctypes.addressof(self._scratch), ctypes.addressof(st)):
            raise IndexError("index out of range in self")  # a token id past the embedding, as torch says it
        return x, out

    def _grow(self, rows: int) -> None:
        """Buffers for `rows` rows: grow-only, from room for a few."""
        if rows > self._rows:
            self._buffers(max(rows, min(self.max_rows, 8)))

    def _race_args(self, race: Race, rows: int) -> tuple:
        """Step's temps, keys, filters and filtered: where a row filters, room for its filtered logits (grow-only;
        192 KiB a row at a 49k vocabulary, so only once a filtering row comes)."""
        if race.filters is None:
            return race.temps.ctypes.data, race.keys.ctypes.data, None, None
        if self._filtered.shape[0] < rows:
            self._filtered = np.empty((rows, self.model.lm_head.out_features), dtype=np.float32)
        return race.temps.ctypes.data, race.keys.ctypes.data, race.filters.ctypes.data, self._filtered.ctypes.data


@dataclass(slots=True)
class Race:
    """Rows of a call whose tokens are drawn, not greedy: each row's temperature (float32 [rows], 0 for a greedy
    row) and each forward's key of each row (int64 [forwards, rows], Sampler.race_keys'), both C-contiguous."""

    temps: np.ndarray
    keys: np.ndarray
    # None where no drawn row filters, or float32 [3, rows]: each row's top_k (0: none), top_p (1: none) and min_p
    # (0: none), Sampler.race_filters'
    filters: np.ndarray | None = None


def build_stack(option: str, model, attention, lib, max_batch_rows: int) -> tuple[FusedStack | None, str]:
    """fuse_layers auto: the stack where it fits (else None, with the reason); off: None. max_batch_rows: the most
    rows a step can have."""
    if option == "off":
        return None, "off"
    why = _why_not(model, attention, lib)
    if why is not None:
        return None, why
    stack = FusedStack(model, attention, lib, max_batch_rows)
    return stack, f"up to {stack.max_rows} rows"
