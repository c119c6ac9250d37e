"""Default plugin: the deterministic fake backend ("fake")."""

from llmserve.hookspecs import hookimpl
from llmserve_fake.backend import FakeBackend, next_token

__all__ = ["FakeBackend", "next_token"]

# eos_token_id may be a list (every one ends a sequence); generation_defaults stands in for a checkpoint's
# generation_config.json (SamplingParams fields, e.g. {"temperature": 0.0, "max_tokens": 8}); hidden_size and
# pooling shape its stand-in embeddings (pooling null: none); generates false and causal false make it an encoder
_OPTIONS = {"vocab_size": 257, "eos_token_id": 256, "max_model_len": 4096, "num_blocks": 2048,
            "step_cost_s": 0.0, "token_cost_s": 0.0, "generation_defaults": {}, "max_decode_forwards": 1,
            "max_decode_forward_rows": None, "hidden_size": 64, "pooling": "last", "generates": True, "causal": True}


def _build(config) -> FakeBackend:
    from llmserve.config import ModelConfig, check_options

    o = check_options(config.backend.options, _OPTIONS, "backend.options (fake)")
    if config.model.model == ModelConfig().model:
        # it loads no model: named "fake" (configs/fake.yaml's name, the docs'), not as the default checkpoint, in
        # the served name and /v1/models' root; the server reads both from this (shared) config
        config.model.model = "fake"
    max_len = config.model.max_model_len or o["max_model_len"]
    return FakeBackend(vocab_size=int(o["vocab_size"]), max_model_len=int(max_len),
                       eos_token_id=o["eos_token_id"], num_blocks=int(o["num_blocks"]),
                       step_cost_s=float(o["step_cost_s"]), token_cost_s=float(o["token_cost_s"]),
                       generation_defaults=dict(o["generation_defaults"]),
                       max_decode_forwards=int(o["max_decode_forwards"]),
                       max_decode_forward_rows=None if o["max_decode_forward_rows"] is None
                       else int(o["max_decode_forward_rows"]),
                       hidden_size=int(o["hidden_size"]), pooling=o["pooling"], generates=bool(o["generates"]),
                       causal=bool(o["causal"]))


@hookimpl
def register_backends(register):
    """Register the deterministic fake backend as "fake"."""
    register("fake", _build)
