"""A Hugging Face checkpoint: its directory (local, or fetched from the hub), its config read as an ArchConfig, its
weight files and their tensors; and seeded dummy weights in its layout. The model sources (sources.py) read
models through these; the loader builds what they hand it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llmserve.config import ModelConfig
from llmserve.errors import ConfigError
from llmserve_torch.arch import ArchConfig
from llmserve_torch.models.family import arch_from_hf


def resolve_model_dir(mc: ModelConfig) -> Path:
    """A local directory as it is; otherwise fetch (or find in the HF cache) a hub id, explaining failures."""
    p = Path(mc.model).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"model.model: {mc.model!r} is a file; pass the directory that holds config.json")
    if mc.model.startswith((".", "/", "~")) or mc.model.count("/") > 1:
        raise ConfigError(f"model.model: no such directory {mc.model!r}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        raise ConfigError(f"model.model: {mc.model!r} is not a local directory and huggingface_hub is not installed")
    patterns = ["*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*.tiktoken", "merges.txt", "vocab.*"]
    # without a network the hub client retries for about a minute: look in the local cache only
    unreachable = os.environ.get("HF_HUB_OFFLINE", "") in ("", "0") and not _hub_reachable()
    try:
        return Path(snapshot_download(mc.model, revision=mc.revision, allow_patterns=patterns,
                                      local_files_only=unreachable))
    except Exception as e:  # offline, unknown repo, gated repo, network down ...
        offline = unreachable or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or "offline" in str(e).lower()
        why = "the Hugging Face hub is offline (HF_HUB_OFFLINE is set or no network)" if offline else \
            f"it could not be fetched from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        raise ConfigError(
            f"model.model: {mc.model!r} is not a local directory and {why}. "
            f"Download it where there is network, e.g. `huggingface-cli download {mc.model} --local-dir ./models/x`, "
            f"then pass that directory: --model ./models/x (or model.model: ./models/x in the config file)"
        ) from None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub endpoint (HF_ENDPOINT) accepts a TCP connection within timeout seconds."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    u = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def read_arch(model_dir: Path, trust_remote_code: bool = False) -> ArchConfig:
    """Read config.json through transformers and normalize it."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.model: {str(model_dir)!r} has no config.json")
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ConfigError(f"model.model: cannot read {model_dir / 'config.json'}: {type(e).__name__}: {e}") from None
    arch = arch_from_hf(cfg)
    gen = model_dir / "generation_config.json"
    if arch.eos_token_id is None and gen.is_file():
        try:
            v = json.loads(gen.read_text()).get("eos_token_id")
            arch.eos_token_id = v[0] if isinstance(v, list) and v else v
        except (OSError, ValueError):
            pass
    return arch


def weight_files(model_dir: Path, load_format: str) -> list[Path]:
    """The checkpoint files to read: safetensors first (auto), single or sharded via the index."""
    kinds = {"auto": ("safetensors", "pt"), "safetensors": ("safetensors",), "pt": ("pt",)}.get(load_format)
    if kinds is None:
        raise ConfigError(f"model.load_format: must be auto, safetensors, pt or dummy, got {load_format!r}")
    for kind in kinds:
        single, index = (("model.safetensors", "model.safetensors.index.json") if kind == "safetensors"
                         else ("pytorch_model.bin", "pytorch_model.bin.index.json"))
        if (model_dir / index).is_file():
            idx = json.loads((model_dir / index).read_text())
            names = sorted(set(idx.get("weight_map", {}).values()))
            missing = [n for n in names if not (model_dir / n).is_file()]
            if missing:
                raise ConfigError(f"{model_dir / index} names shards that are missing: {', '.join(missing)}")
            return [model_dir / n for n in names]
        if (model_dir / single).is_file():
            return [model_dir / single]
        found = sorted(model_dir.glob("*.safetensors" if kind == "safetensors" else "*.bin"))
        if found:
            return found
    raise ConfigError(f"model.model: no weights in {str(model_dir)!r} for load_format {load_format!r} "
                      "(looked for model.safetensors, sharded *.safetensors with an index, pytorch_model.bin); "
                      "use load_format: dummy for random weights")


def read_state_dict(files: list[Path], normalize) -> dict[str, torch.Tensor]:
    """Tensors from safetensors or torch .bin files, names normalized by the model family."""
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt", device="cpu") as fh:
                items = ((k, fh.get_tensor(k)) for k in fh.keys())
                for k, t in items:
                    name = normalize(k)
                    if name is not None:
                        sd[name] = t
        else:
            for k, t in torch.load(str(f), map_location="cpu", weights_only=True, mmap=True).items():
                name = normalize(k)
                if name is not None:
                    sd[name] = t
    return sd


def dummy_state_dict(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in checkpoint layout: N(0, 0.02) matrices, unit norm weights, small biases."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if len(shape) == 1 and ("norm" in name or name.split(".")[-2].startswith("ln")) and name.endswith("weight"):
            sd[name] = torch.ones(shape)
        else:
            sd[name] = torch.empty(shape).normal_(0.0, 0.02, generator=g)
    return sd
