"""ServingModel: what the routes read of the model they serve: tokenizer, grammar check, limits, generation defaults.

The routes never read an engine. Where the engine runs in this thread, `ServingModel.of(engine)` shares its
tokenizer and grammar engine; where it runs elsewhere (a child process, Ray replicas, another machine), the engine
describes itself (`describe_model`) and `ServingModel.from_facts` builds the tokenizer and grammar engine by the
engine's own rules, so both sides tokenize, validate and compile alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.config import EngineConfig
from llmserve.constraints import Constraints
from llmserve.engine import Engine, build_constraints, build_tokenizer
from llmserve.interfaces import Tokenizer
from llmserve.plugins import PluginSet
from llmserve.pooling import check_pooling
from llmserve.request import PoolingParams, apply_generation_defaults


@dataclass(eq=False)
class ServingModel:
    """The model a server serves, as its routes read it; read-only once built."""

    config: EngineConfig
    plugins: PluginSet  # the plugin set the server was built with (tool and reasoning parsers, response stores)
    tokenizer: Tokenizer | None
    constraints: Constraints  # .check(sp): compiles a request's grammar (cached), a 400 for a bad one
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    # the model's sampling defaults for the fields a request leaves out, and who said so (for /v1/models)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    generation_defaults_source: str | None = None
    pooling: str | None = None  # the pooling embedding requests get; None: no embeddings
    embedding_size: int | None = None
    generates: bool = True  # False: an encoder, embeddings only
    backend_info: dict[str, Any] = field(default_factory=dict)  # the backend's describe()

    @classmethod
    def of(cls, e: Engine) -> ServingModel:
        """The model of an engine built in this process (its tokenizer and grammar engine shared, not rebuilt)."""
        return cls(config=e.config, plugins=e.plugins, tokenizer=e.tokenizer, constraints=e.constraints,
                   **_limits(e))

    @classmethod
    def from_facts(cls, config: EngineConfig, plugins: PluginSet, facts: dict[str, Any]) -> ServingModel:
        """The model an engine elsewhere described (`describe_model`): tokenizer and grammar built by its rules."""
        # the names the engine serves under (a backend may name them, as the fake one does): the server answers so
        config.model.model, config.model.served_model_name = facts["model"], facts["served_model_name"]
        tok = build_tokenizer(config, plugins, facts["default_tokenizer"], facts["tokenizer_path"])
        limits = {k: facts[k] for k in _LIMITS}
        return cls(config=config, plugins=plugins, tokenizer=tok,
                   constraints=build_constraints(config, plugins, tok, facts["vocab_size"]), **limits)

    def defaults(self, given: dict[str, Any], fields, room: int | None = None) -> dict[str, Any]:
        """`fields` as a request gives them, the model's generation defaults for the rest (request.py's rule)."""
        return apply_generation_defaults(self.generation_defaults, given, fields, room)

    def check_pooling(self, p: PoolingParams) -> PoolingParams:
        """p with its kind resolved to the model's; InvalidRequestError naming a field this model cannot take."""
        return check_pooling(p, self.pooling, self.embedding_size, self.config)


_LIMITS = ("max_model_len", "vocab_size", "eos_token_id", "generation_defaults", "generation_defaults_source",
           "pooling", "embedding_size", "generates", "backend_info")


def _limits(e: Engine) -> dict[str, Any]:
    return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "eos_token_id": e.eos_token_id,
            "generation_defaults": dict(e.generation_defaults),
            "generation_defaults_source": e.generation_defaults_source, "pooling": e.pooling,
            "embedding_size": e.embedding_size, "generates": e.generates, "backend_info": e.backend.describe()}


def describe_model(e: Engine) -> dict[str, Any]:
    """What ServingModel.from_facts needs of an engine built elsewhere: limits, defaults, its tokenizer's source."""
    return {"model": e.config.model.model, "served_model_name": e.config.served_model_name, **_limits(e),
            "tokenizer_path": e.backend.tokenizer_path, "default_tokenizer": e.backend.default_tokenizer}
