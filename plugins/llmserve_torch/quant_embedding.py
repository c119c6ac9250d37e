"""An embedding table kept in its file's quantized form: the rows a step looks up are dequantized as they are read.

A GGUF's token embedding is quantized (Q8_0, Q4_K, Q6_K ...), and most small models tie it to the LM head. Holding it
as a dense float table beside the packed head cost the 0.5B model 272 MB of bf16 and ~2.5 s of every start
(repacking the file's blocks to find the values, then dequantizing 136 M of them), for a lookup that reads a few rows
a step. Here the table is the packed weight our matmul kernels run (the head's own bytes where tied, read back from
the packed cache like any linear), and `llmserve_quant_rows` dequantizes a step's rows exactly as
QuantWeight.dequantize does, so the rows, and every greedy token after them, are the dense table's.
"""

from __future__ import annotations

import torch

from llmserve_torch.quant import QuantLinear, _own_kernels


class QuantEmbedding:
    """The rows of a group-format QuantLinear's weight as an embedding table: [vocab, hidden], looked up by id."""

    def __init__(self, weight: QuantLinear, dtype: torch.dtype, shared: bool):
        self.linear = weight  # the packed weight (the tied LM head itself where `shared`)
        self.fmt = weight.fmt
        self.packed = weight.kernel_tensors()[0]
        self.shape = (weight.out_features, weight.in_features)
        self.dtype = dtype
        self.shared = shared

    @classmethod
    def of(cls, lin, dtype: torch.dtype, shared: bool) -> QuantEmbedding | None:
        """The table over lin's packed weight, or None where our kernels do not hold it in a group format."""
        if not isinstance(lin, QuantLinear) or lin.fmt is None or _own_kernels() is None:
            return None
        return cls(lin, dtype, shared)

    @property
    def nbytes(self) -> int:
        """Bytes the table adds to the model's: none where it is the LM head's weight."""
        return 0 if self.shared else self.linear.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ids (any shape) in the model's dtype: [*ids.shape, hidden]; IndexError for an id past the
        table, as torch's embedding raises."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        native = self.dtype in (torch.float32, torch.bfloat16)  # what the kernel writes; others are cast from float32
        out = torch.empty((flat.shape[0], self.shape[1]), dtype=self.dtype if native else torch.float32)
        if _own_kernels().llmserve_quant_rows(self.fmt, self.packed.data_ptr(), self.shape[0], self.shape[1],
                                              flat.data_ptr(), flat.shape[0], out.data_ptr(), out.stride(0),
                                              out.element_size(), torch.get_num_threads()):
            raise IndexError("index out of range in self")
        return out.to(self.dtype).reshape(*ids.shape, self.shape[1])


def embedding_rows(table, ids: torch.Tensor) -> torch.Tensor:
    """The rows of ids from a dense table (torch's embedding) or a QuantEmbedding."""
    if isinstance(table, QuantEmbedding):
        return table(ids)
    return torch.nn.functional.embedding(ids, table)
