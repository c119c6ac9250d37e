"""A GGUF file's header, read fast: metadata values on demand, tensor descriptions, tensor data as views of one mmap.

llama.cpp's `gguf.GGUFReader` builds numpy views for every part of every metadata field; a 49k-token vocabulary is
hundreds of thousands of them, 5 s at every start for a 100 MB file. This reads the header with struct, keeps each
value's offset, and decodes a value only when asked (the vocabulary only when the tokenizer is built, once per file).
Tensors are shaped as GGUFReader shapes them (rows first; a quantized row as its bytes), so gguf.quants works on them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
_SCALARS = {  # value type → struct format (little-endian)
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}
# tensor types numpy holds element by element (the rest are blocks, read as bytes)
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (its message says where it stopped)."""


@dataclass(slots=True)
class Tensor:
    """One tensor: its name, ggml type, dims (ne0 first, as the file stores them) and its bytes in the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data: np.ndarray  # rows first: [.., rows, cols], a block type's row as [.., rows, bytes]
    offset: int = 0  # of its first byte in the file


class GGUFFile:
    """An open GGUF file: `meta(key)` decodes one metadata value, `tensors` describes every tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        try:
            self._values, self.tensors = self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, KeyError) as e:  # truncated or corrupt
            raise GGUFFormatError(f"malformed GGUF header ({type(e).__name__}: {e})") from None

    # --- reading primitives -------------------------------------------------------------------

    def _scalar(self, fmt: str, offs: int) -> tuple[Any, int]:
        return struct.unpack_from(fmt, self._buf, offs)[0], offs + struct.calcsize(fmt)

    def _string(self, offs: int) -> tuple[str, int]:
        n, offs = self._scalar("<Q", offs)
        if offs + n > len(self._buf):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file at offset {offs}")
        return bytes(self._buf[offs:offs + n]).decode("utf-8"), offs + n

    def _skip(self, vtype: int, offs: int) -> int:
        """The offset after a value of vtype at offs (arrays walked without decoding them)."""
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            n, offs = self._scalar("<Q", offs)
            return offs + n
        if vtype == GGUFValueType.ARRAY:
            etype, offs = self._scalar("<I", offs)
            count, offs = self._scalar("<Q", offs)
            etype = GGUFValueType(etype)
            if etype in _NUMPY:
                return offs + count * np.dtype(_NUMPY[etype]).itemsize
            for _ in range(count):  # strings or nested arrays: each has its own length
                offs = self._skip(etype, offs)
            return offs
        return offs + struct.calcsize(_SCALARS[vtype])

    def _decode(self, vtype: int, offs: int) -> Any:
        """The value of vtype at offs: a scalar, a str, or a list (GGUFReader's field.contents())."""
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._string(offs)[0]
        if vtype != GGUFValueType.ARRAY:
            return self._scalar(_SCALARS[vtype], offs)[0]
        etype, offs = self._scalar("<I", offs)
        count, offs = self._scalar("<Q", offs)
        etype = GGUFValueType(etype)
        if etype in _NUMPY:
            return np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=offs).tolist()
        out = []
        for _ in range(count):
            out.append(self._decode(etype, offs))
            offs = self._skip(etype, offs)
        return out

    # --- the header ---------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, tuple[int, int]], list[Tensor]]:
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFFormatError(f"no GGUF magic (the file starts {bytes(self._buf[:4])!r})")
        version, offs = self._scalar("<I", 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (this reader reads little-endian versions 2 and 3)")
        n_tensors, offs = self._scalar("<Q", offs)
        n_kv, offs = self._scalar("<Q", offs)
        values: dict[str, tuple[int, int]] = {}  # key → (value type, offset of the value)
        for _ in range(n_kv):
            key, offs = self._string(offs)
            vtype, offs = self._scalar("<I", offs)
            values[key] = (vtype, offs)
            offs = self._skip(vtype, offs)
        infos = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            n_dims, offs = self._scalar("<I", offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offs)
            offs += 8 * n_dims
            ttype, offs = self._scalar("<I", offs)
            rel, offs = self._scalar("<Q", offs)
            infos.append((name, dims, GGMLQuantizationType(ttype), rel))
        self._values = values
        align = int(self.meta("general.alignment", 32))
        start = offs + (-offs % align)
        tensors, seen = [], set()
        for name, dims, ttype, rel in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[ttype]
            n_bytes = n * type_size // block
            begin = start + rel
            if begin + n_bytes > len(self._buf):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
            rows_first = tuple(reversed(dims))
            if ttype in _ELEMENTS:
                data = np.frombuffer(self._buf, dtype=_ELEMENTS[ttype], count=n, offset=begin).reshape(rows_first)
            else:
                shape = (*rows_first[:-1], rows_first[-1] // block * type_size)
                data = np.frombuffer(self._buf, dtype=np.uint8, count=n_bytes, offset=begin).reshape(shape)
            tensors.append(Tensor(name, ttype, tuple(int(d) for d in dims), n, n_bytes, data, begin))
        return values, tensors

    def release(self, t: Tensor) -> None:
        """Drop a tensor's pages from this process's resident set once read (they stay in the page cache): a load
        that repacks the file tensor by tensor then holds one tensor's bytes at a time, not the whole file's."""
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page  # whole pages inside the tensor only (its neighbours may be unread)
        end = (t.offset + t.n_bytes) // page * page
        if end > start and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def keys(self) -> list[str]:
        """Every metadata key, in file order."""
        return list(self._values)

    def typed(self, key: str) -> tuple[list[GGUFValueType], list[Any]]:
        """A value's types ([type], or [ARRAY, element type]) and its elements (one for a scalar or a string)."""
        vtype, offs = self._values[key]
        vtype = GGUFValueType(vtype)
        if vtype != GGUFValueType.ARRAY:
            return [vtype], [self._decode(vtype, offs)]
        etype = GGUFValueType(self._scalar("<I", offs)[0])
        return [vtype, etype], self._decode(vtype, offs)

    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value (decoded now: strings as str, arrays as lists), or default when the key is absent."""
        found = self._values.get(key)
        if found is None:
            return default
        return self._decode(*found)


@dataclass(slots=True)
class _Field:
    """What transformers reads of a gguf.ReaderField: each element as its own numpy part, the parts that are data."""

    name: str
    types: list[GGUFValueType]
    parts: list[np.ndarray]
    data: list[int]


class ReaderFacade:
    """gguf.GGUFReader's `fields` and `tensors` as transformers' GGUF tokenizer loader reads them, made from a
    GGUFFile: the same values, without GGUFReader's seconds of numpy views (export_tokenizer patches it in)."""

    def __init__(self, f: GGUFFile):
        self.tensors = f.tensors
        self.fields: dict[str, _Field] = {}
        for key in f.keys():
            types, values = f.typed(key)
            etype = types[-1]
            if etype == GGUFValueType.STRING:
                parts = [np.frombuffer(v.encode("utf-8"), dtype=np.uint8) for v in values]
            else:
                whole = np.asarray(values, dtype=_NUMPY[etype])
                parts = [whole[i:i + 1] for i in range(len(values))]
            self.fields[key] = _Field(key, types, parts, list(range(len(parts))))

    def get_field(self, key: str) -> _Field | None:
        """The field named key, or None."""
        return self.fields.get(key)
