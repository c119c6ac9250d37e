"""Pooling: how an embedding sequence's final hidden states become one vector, chunk by chunk.

A backend computes an embedding sequence's prefill like any other (in the same step, chunked like any other) and
returns, for each chunk, the sum of its final-norm hidden states over the rows `pooled_rows` names
(ModelOutput.pooled). The engine adds the chunks up (`accumulate`) and, after the last, makes the vector (`finish`):
divided by the prompt's length for mean pooling, cut to the asked dimensions, L2-normalized. So mean pooling needs
no state in the backend, and a sequence preempted and recomputed starts its sum afresh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.request import PoolingParams

# last: the last prompt token's state (decoder LMs: it has seen every token); mean: every token's, averaged;
# cls: the first token's (BERT's [CLS])
POOLING_TYPES = ("last", "mean", "cls")


def pooled_rows(kind: str, start: int, n: int, total: int) -> range:
    """The rows of a chunk (positions start..start+n of a total-token prompt) whose states add to its pooled sum."""
    if kind == "mean":
        return range(n)
    if kind == "cls":
        return range(1) if start == 0 else range(0)
    return range(n - 1, n) if start + n == total else range(0)


def accumulate(acc: list[float] | None, start: int, part: Sequence[float] | None) -> list[float] | None:
    """The running sum after a chunk that starts at `start` (a chunk at 0 starts afresh: a recomputed prefill)."""
    if start == 0:
        acc = None
    if part is None:
        return acc
    return list(part) if acc is None else [a + b for a, b in zip(acc, part)]


def finish(acc: Sequence[float], kind: str, total: int, params: PoolingParams) -> list[float]:
    """The embedding: the sum averaged (mean), cut to params.dimensions, L2-normalized when params.normalize."""
    vec = [v / total for v in acc] if kind == "mean" else list(acc)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        norm = math.sqrt(math.fsum(v * v for v in vec))
        if norm > 0:
            vec = [v / norm for v in vec]
    return vec


def check_pooling(p: PoolingParams, pooling: str | None, size: int | None, config: Any) -> PoolingParams:
    """p with its kind resolved to the model's (`pooling`) where left out; InvalidRequestError naming the field it
    cannot take (no pooling here, an unknown kind, dimensions a model not trained for them cannot cut to)."""
    if pooling is None:
        raise InvalidRequestError(f"the {config.backend.name} backend computes no embeddings", param="input",
                                  code="embeddings_unsupported")
    kind = p.kind or pooling
    if kind not in POOLING_TYPES:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {kind!r}",
                                  param="pooling")
    dims = p.dimensions
    if dims is not None and dims != size:
        if not config.model.matryoshka:
            raise InvalidRequestError(
                f"the model {config.served_model_name!r} makes embeddings of {size} dimensions and was not "
                f"trained to be cut shorter (Matryoshka: model.matryoshka): leave dimensions out or set it to "
                f"{size}", param="dimensions")
        if not 1 <= dims <= size:
            raise InvalidRequestError(f"dimensions must be between 1 and {size} (the model's size), got {dims}",
                                      param="dimensions")
    return dataclasses.replace(p, kind=kind)
