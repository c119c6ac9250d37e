"""The GGUF caches, per file sha256, each written once into a temporary directory and renamed into place: the
tokenizer files and generation config every start reads (transformers takes seconds to build a tokenizer from
GGUF metadata), and, only for `model.quantization: none`, a dequantized checkpoint (config.json, model.safetensors)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from llmserve.errors import ConfigError
from llmserve_torch.cache_paths import cache_root
from llmserve_torch.generation_config import FILE, from_gguf
from llmserve_torch.gguf_file import GGUFCheckpoint
from llmserve_torch.gguf_reader import GGUFFile, ReaderFacade

log = logging.getLogger("llmserve.torch")

# bump when a cache changes what it holds: caches of another format are rebuilt (format 1 held dequantized weights
# beside the tokenizer; they are replaced, freeing their disk, the next time their file is served)
FORMAT = 2
MARKER = "llmserve-gguf.json"  # written last: a directory without it is not a cache


def file_sha256(path: Path, index: Path) -> str:
    """The file's sha256, remembered in index by (path, size, mtime) so a large file is hashed once."""
    st = path.stat()
    key = str(path.resolve())
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"]
    log.info("GGUF %s: hashing its %.0f MB to find its converted cache", path.name, st.st_size / 1e6)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    known[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    _write_atomic(index, json.dumps(known, indent=1))
    return digest


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _marker(d: Path) -> dict | None:
    """The finished cache's record, or None when d is missing, half-written or of another format."""
    try:
        info = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("format") == FORMAT else None


def _remove_orphans(root: Path, name: str) -> None:
    """Delete temporary directories that killed first loads of this entry left behind."""
    for d in root.glob(f".tmp-{name}-[0-9]*"):
        pid = d.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
            continue  # that process still runs and may still be writing
        except (ValueError, ProcessLookupError):
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            continue


@contextmanager
def _fast_reader(path: Path):
    """gguf.GGUFReader, for this file, replaced by our reader's facade while transformers reads its metadata (the
    real one spends seconds building numpy views of a 49k-150k-token vocabulary, once per field part)."""
    import gguf

    real = gguf.GGUFReader
    mine = path.resolve()

    def reader(p, *args, **kwargs):
        return ReaderFacade(GGUFFile(mine)) if Path(p).resolve() == mine else real(p, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def export_tokenizer(path: Path, out: Path) -> bool:
    """Save the tokenizer and chat template transformers builds from the GGUF metadata; False when it cannot."""
    from transformers import AutoTokenizer

    try:
        with _fast_reader(path):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(out))
    except Exception as e:  # an unsupported tokenizer type, a malformed vocabulary ...
        log.warning("GGUF %s: no tokenizer could be built from its metadata (%s: %s); set model.tokenizer to a "
                    "directory holding the model's tokenizer files", path.name, type(e).__name__, e)
        return False
    return True


def _root() -> Path:
    root = cache_root() / "gguf"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the GGUF cache directory {root} ({e}); set LLMSERVE_CACHE to a writable "
                          "directory") from None
    return root


def _build(root: Path, name: str, path: Path, what: str, fill) -> dict:
    """The finished cache entry root/name (fill(tmp) writing it on the first call), as its marker's record."""
    final = root / name
    info = _marker(final)
    if info is not None:
        log.info("GGUF %s: reading the %s cached in %s", path.name, what, final)
        return info
    t0 = time.perf_counter()
    log.info("GGUF %s: first load: writing its %s once into %s (later starts read that)", path.name, what, final)
    _remove_orphans(root, name)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        record = {"format": FORMAT, "source": str(path.resolve()), **fill(tmp),
                  "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / MARKER).write_text(json.dumps(record, indent=1))
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF %s: %s written in %.1fs", path.name, what, time.perf_counter() - t0)
    return record


def cached_metadata(path: Path, wait: bool = True) -> tuple[Path, bool | Future]:
    """The directory holding the GGUF's tokenizer files and generation config (written on the first call; no
    weights: the quantized tensors are repacked from the file itself), and whether it holds a tokenizer: a bool, or
    with wait=False a Future of it. A first call writes the entry on a thread of its own (transformers builds the
    tokenizer in seconds), so a caller that does not wait loads the weights meanwhile; a second caller of this
    process waits for the same thread."""
    root = _root()
    sha = file_sha256(path, root / "sha256.json")
    entry = root / sha

    def fill(tmp: Path) -> dict:
        (tmp / FILE).write_text(json.dumps(from_gguf(GGUFCheckpoint(path))))  # the EOS ids and sampling defaults
        tokenizer = export_tokenizer(path, tmp)
        if tokenizer:
            from llmserve_tokenizers.hf import write_snapshot

            # the tokenizer as the "hf" tokenizer serves these files (reloaded: Qwen2Tokenizer rebuilds its pipeline,
            # NFC and Qwen's split, over what the metadata gave), so every start reads it without transformers
            write_snapshot(str(tmp))
        return {"sha256": sha, "tokenizer": tokenizer}

    def build() -> bool:
        return _build(root, sha, path, "tokenizer and metadata", fill)["tokenizer"]

    with _building_lock:
        future = _building.get(entry)
        if future is None:
            future = Future()
            if _marker(entry) is not None:  # written already: read at once
                future.set_result(build())
            else:
                _building[entry] = future
                threading.Thread(target=_settle, args=(future, entry, build), name="llmserve-gguf-metadata",
                                 daemon=True).start()
    return entry, future.result() if wait else future


# cache entries a thread of this process is writing, and their results to come
_building: dict[Path, Future] = {}
_building_lock = threading.Lock()


def _settle(future: Future, entry: Path, build) -> None:
    """Run build() into future, then forget the entry's thread."""
    try:
        future.set_result(build())
    except BaseException as e:  # (the waiter re-raises it)
        future.set_exception(e)
    finally:
        with _building_lock:
            _building.pop(entry, None)


def cached_dense(path: Path) -> Path:
    """A checkpoint directory (config.json, model.safetensors) with every tensor of the GGUF dequantized, for
    `model.quantization: none` (written on the first call that asks)."""
    from safetensors.torch import save_file

    root = _root()
    sha = file_sha256(path, root / "sha256.json")

    def fill(tmp: Path) -> dict:
        ckpt = GGUFCheckpoint(path)  # checks architecture and tensor types before any slow work
        types = ", ".join(f"{n} {t}" for t, n in ckpt.type_counts().most_common())
        log.info("GGUF %s: dequantizing %d tensors (%s)", path.name, len(ckpt.tensors), types)
        ckpt.hf_config().save_pretrained(str(tmp))
        t1 = time.perf_counter()
        sd = ckpt.state_dict()
        t2 = time.perf_counter()
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del sd
        log.info("GGUF %s: dequantized in %.1fs, wrote model.safetensors in %.1fs", path.name, t2 - t1,
                 time.perf_counter() - t2)
        return {"sha256": sha, "tensor_types": dict(ckpt.type_counts())}

    _build(root, f"{sha}-dense", path, "dequantized checkpoint", fill)
    return root / f"{sha}-dense"


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place; a concurrent load that finished first wins."""
    if final.exists():
        if _marker(final) is not None:
            return
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")  # an old format, or a foreign leftover
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if _marker(final) is None:  # not a concurrent winner: a real failure
            raise
