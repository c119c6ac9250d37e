"""Front: an Engine without a model, for a server whose engine runs elsewhere (a child process, Ray replicas).

The routes read an Engine for the tokenizer, the limits, the grammar engine and the plugins;
Front builds those by Engine's own rules from the facts the real engine describes
(`engine_facts`), so both sides tokenize, validate and compile alike.
"""

from __future__ import annotations

from typing import Any

from llmserve.engine import Engine, build_constraints, build_tokenizer


def engine_facts(e: Engine) -> dict[str, Any]:
    """What a Front needs of a built engine: limits, vocabulary, sampling defaults, its tokenizer's source."""
    return {"model": e.config.model.model, "served_model_name": e.config.served_model_name,
            "max_model_len": e.max_model_len, "vocab_size": e.vocab_size,
            "generation_defaults": dict(e.generation_defaults),
            "generation_defaults_source": e.generation_defaults_source, "eos_token_id": e.eos_token_id,
            "tokenizer_path": e.backend.tokenizer_path, "default_tokenizer": e.backend.default_tokenizer,
            "backend": e.backend.describe(), "pooling": e.pooling, "embedding_size": e.embedding_size,
            "generates": e.generates}


class RemoteBackend:
    """The backend facts the routes read, as the engine described them."""

    def __init__(self, facts: dict[str, Any]):
        self.vocab_size = facts["vocab_size"]
        self.max_model_len = facts["max_model_len"]
        self.eos_token_id = facts["eos_token_id"]
        self.default_tokenizer = facts["default_tokenizer"]
        self.tokenizer_path = facts["tokenizer_path"]
        self._info = facts["backend"]

    def describe(self) -> dict[str, Any]:
        return dict(self._info)


class Front(Engine):
    """An Engine with no model and no KV cache: the tokenizer, grammar and limits a server validates with."""

    def __init__(self, config, plugins, facts: dict[str, Any]):  # noqa: D107 - Engine.__init__ would load the model
        self.config, self.plugins = config, plugins
        # the names the engine serves under (a backend may name them, as the fake one does): the server answers so
        config.model.model, config.model.served_model_name = facts["model"], facts["served_model_name"]
        self.backend = RemoteBackend(facts)
        self.vocab_size = facts["vocab_size"]
        self.max_model_len = facts["max_model_len"]
        self.eos_token_id = facts["eos_token_id"]
        self.generation_defaults = dict(facts["generation_defaults"])
        self.generation_defaults_source = facts["generation_defaults_source"]
        self.pooling, self.embedding_size, self.generates = facts["pooling"], facts["embedding_size"], facts["generates"]
        # Engine's own rules: the same tokenizer the engine built
        self.tokenizer = build_tokenizer(config, plugins, facts["default_tokenizer"], facts["tokenizer_path"])
        self.constraints = build_constraints(config, plugins, self.tokenizer, self.vocab_size)
        self.metric_sinks = []
