"""A GGUF's quantized linears as our kernels hold them, cached beside its tokenizer: a later start reads them back;
and the state-dict stand-ins that let a model be built from a file without holding every weight unpacked at once.

Repacking a file's blocks into the kernels' layout (unpacking every value to a byte, regrouping fused q|k|v, bit
planes, tiles) took most of a start: 5 s and a transient byte a weight (540 MB) for a 0.5B model. The first start
that builds the model writes each linear's packed tensor into one safetensors file, keyed by what its layout depends
on (the file, our kernel build and tile, this module's format); a later start puts a `Packed` placeholder in the
state dict for each linear weight the file holds and builds the linear from the stored tensor, read by mmap and copied
once into its final place. Anything that does not match is rebuilt and written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from llmserve_torch import kernel_library
from llmserve_torch.quant import QuantLinear, QuantWeight, own_quant_tile

log = logging.getLogger("llmserve.torch")

FORMAT = 1  # bump when what a linear's entry holds changes


class Packed(QuantWeight):
    """A state-dict placeholder for a linear weight whose packed form the cache holds (no values are read)."""

    __slots__ = ("names", "out_in")

    def __init__(self, names: tuple[str, ...], out_in: tuple[int, int], source: str):
        super().__init__("packed", None, None, None, source)
        self.names, self.out_in = names, out_in

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the matrix it stands for."""
        return self.out_in


class Deferred(QuantWeight):
    """A state-dict stand-in for a quantized linear weight read from the file only when the model makes its linear:
    a first start holds one layer's unpacked values (a byte a weight) at a time, not the whole model's."""

    __slots__ = ("names", "out_in", "load")

    def __init__(self, names: tuple[str, ...], out_in: tuple[int, int], source: str, load):
        super().__init__("deferred", None, None, None, source)
        self.names, self.out_in, self.load = names, out_in, load  # load() → the QuantWeight

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the matrix it stands for."""
        return self.out_in


def cat_packed(parts: list[Packed]) -> Packed:
    """Placeholders stacked along the output axis, as cat_rows stacks weights."""
    return Packed(sum((p.names for p in parts), ()), (sum(p.out_in[0] for p in parts), parts[0].out_in[1]),
                  "+".join(sorted({p.source for p in parts})))


def _key(sha256: str, family: str) -> str:
    facts = [FORMAT, sha256, family, kernel_library.library_id(), own_quant_tile()]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:20]


class PackedCache:
    """One GGUF's packed linears for this kernel build: `entries` (names → meta) once read, `save()` after a build."""

    def __init__(self, directory: Path, sha256: str, family: str):
        self.path = directory / f"packed-{_key(sha256, family)}.safetensors"
        self.entries: dict[tuple[str, ...], dict] = {}
        self._file = None
        wait_for_saves(self.path)  # (another load of this process may be writing it)
        if self.path.is_file():
            try:
                from safetensors import safe_open

                self._file = safe_open(str(self.path), framework="pt")
                meta = json.loads(self._file.metadata()["llmserve"])
                self.entries = {tuple(e["names"]): e for e in meta["linears"]}
            except Exception as e:  # unreadable or truncated: rebuilt by this start
                log.warning("%s: unreadable (%s: %s); repacking from the GGUF", self.path.name, type(e).__name__, e)
                self._file, self.entries = None, {}

    def covers(self) -> set[str]:
        """The state-dict names whose weights the cache holds packed."""
        return {n for names in self.entries for n in names}

    def linear(self, names: tuple[str, ...], bias: torch.Tensor | None, plan, densify) -> QuantLinear | None:
        """The linear over the cached tensor of these weights, or None where the cache has no such entry."""
        e = self.entries.get(tuple(names))
        if e is None or self._file is None:
            return None
        return QuantLinear.from_packed(self._file.get_tensor(e["tensor"]), e["kind"], e["source"], e["fmt"],
                                       tuple(e["out_in"]), bias, plan, densify)

    def save(self, made: list[tuple[tuple[str, ...], QuantLinear]], background: bool = False) -> None:
        """Write the packed linears (each once by its names), atomically; a failure only costs the next start time.
        With background, on a thread of its own (the write releases the GIL): a first start goes on to serve
        meanwhile, instead of waiting ~1 s for a 0.5B model's 400 MB; the process waits for it before it exits."""
        tensors, linears = {}, []
        for names, lin in made:
            if lin.fmt is None or names in {tuple(e["names"]) for e in linears}:
                continue
            name = f"w{len(linears)}"
            tensors[name] = lin.kernel_tensors()[0].contiguous()
            linears.append({"names": list(names), "tensor": name, "kind": lin.kind, "source": lin.source,
                            "fmt": lin.fmt, "out_in": [lin.out_features, lin.in_features]})
        if not linears:
            return
        if not background:
            self._write(tensors, linears)
            return
        thread = threading.Thread(target=self._write, args=(tensors, linears), name="llmserve-packed-cache")
        with _saving_lock:
            _saving[self.path] = thread
        thread.start()  # (not a daemon: an exit waits for the file rather than leave a half-written temporary)

    def _write(self, tensors: dict[str, torch.Tensor], linears: list[dict]) -> None:
        """The safetensors file, written under a temporary name and renamed into place."""
        from safetensors.torch import save_file

        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}-")
            os.close(fd)
            save_file(tensors, tmp, metadata={"llmserve": json.dumps({"format": FORMAT, "linears": linears})})
            os.replace(tmp, self.path)
            log.info("packed linears cached in %s (%.0f MB): later starts read them instead of repacking",
                     self.path, self.path.stat().st_size / 1e6)
        except Exception as e:  # (a full disk: OSError, or safetensors' own error)
            log.warning("could not cache the packed linears in %s (%s)", self.path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


# the packed caches a thread of this process is writing (PackedCache.save with background)
_saving: dict[Path, threading.Thread] = {}
_saving_lock = threading.Lock()


def wait_for_saves(path: Path | None = None) -> None:
    """Wait until the background writes of the cache at path (or of every cache) are done."""
    with _saving_lock:
        threads = [t for p, t in _saving.items() if path is None or p == path]
    for t in threads:
        t.join()
    with _saving_lock:
        for p in [p for p, t in _saving.items() if not t.is_alive()]:
            del _saving[p]
