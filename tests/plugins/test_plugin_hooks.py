"""One test per hook spec (named test_hook_<spec>): a plugin implements it and the core uses what it registered.

tests/plugins/test_plugin_meta.py fails when a hook spec has no test of this name.
"""

from __future__ import annotations

import argparse
import logging
import types

from llmserve.engine import Engine
from llmserve.hookspecs import hookimpl
from llmserve.interfaces import MetricSink, Tokenizer
from llmserve.plugins import load_plugins
from llmserve.request import SamplingParams
from llmserve_fake import FakeBackend
from llmserve_paged_cache import PagedAllocator
from llmserve_scheduler import ContinuousScheduler


def plugin(name: str, **hooks) -> types.ModuleType:
    """A plugin object as pluggy sees one: a module with @hookimpl functions."""
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, hookimpl(fn))
    return mod


FAKE = {"backend": {"name": "fake"}}


def test_hook_register_backends():
    seen = {}

    class ConstantBackend(FakeBackend):
        """Always samples token 65 ("A")."""

        def execute(self, batch):
            out = super().execute(batch)
            out.sampled_token_ids = [None if t is None else 65 for t in out.sampled_token_ids]
            return out

    def factory(config):
        seen["config"] = config
        return ConstantBackend(num_blocks=64)

    p = plugin("constant_plugin", register_backends=lambda register: register("constant", factory))
    engine = Engine.from_config({"backend": {"name": "constant"}, "tokenizer": {"name": "byte"}},
                                extra_plugins=[p])
    assert seen["config"] is engine.config
    assert isinstance(engine.backend, ConstantBackend)
    assert engine.scheduler_stats().cache.num_blocks == 64  # the core asked this backend how much KV it holds
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4)) == [[65, 65, 65, 65]]
    assert engine.plugins.get("backend", "constant").plugin == "constant_plugin"


def test_hook_register_schedulers():
    seen = {}

    class NewestFirst(ContinuousScheduler):
        """LIFO: the request that arrived last is admitted first."""

        def order_key(self, request):
            return (-request.arrival_seq, request.index)

    def factory(config, allocator):
        seen["args"] = (config, allocator)
        return NewestFirst(allocator, max_num_seqs=config.scheduler.max_num_seqs,
                           max_num_batched_tokens=config.scheduler.max_num_batched_tokens)

    p = plugin("lifo_plugin", register_schedulers=lambda register: register("lifo", factory))
    engine = Engine.from_config({**FAKE, "scheduler": {"name": "lifo", "max_num_seqs": 1}}, extra_plugins=[p])
    assert seen["args"][0] is engine.config and engine.scheduler.allocator is seen["args"][1]
    for i in range(3):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"r{i}")
    order = []
    while engine.has_unfinished:
        order += [o.request_id for o in engine.step().outputs if o.finished]
    assert order == ["r2", "r1", "r0"]


def test_hook_register_cache_allocators():
    seen = {}

    class CountingAllocator(PagedAllocator):
        """Counts allocations, to show the engine's scheduler goes through this object."""

        calls = 0

        def allocate(self, *args, **kwargs):
            CountingAllocator.calls += 1
            return super().allocate(*args, **kwargs)

    def factory(config, num_blocks):
        seen["args"] = (config, num_blocks)
        return CountingAllocator(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)

    p = plugin("counting_plugin", register_cache_allocators=lambda register: register("counting", factory))
    engine = Engine.from_config({**FAKE, "cache": {"name": "counting", "num_blocks": 40, "block_size": 8}},
                                extra_plugins=[p])
    assert seen["args"] == (engine.config, 40)
    assert isinstance(engine.scheduler.allocator, CountingAllocator)  # the scheduler owns it
    engine.generate([[1] * 20], SamplingParams(max_tokens=3, ignore_eos=True))
    assert CountingAllocator.calls >= 3  # the prompt's step, then a decode step per further token
    stats = engine.stats()["cache"]  # the engine reports this allocator's state
    assert stats["num_blocks"] == 40 and stats["used_blocks"] == 0  # the finished sequence was freed


def test_hook_register_tokenizers():
    class Letters(Tokenizer):
        """Token i is the letter chr(97 + i % 26); 256 is EOS."""

        eos_token_id = 256
        vocab_size = 257

        def encode(self, text, add_special_tokens=True):
            return [ord(c) - 97 for c in text]

        def decode(self, token_ids, skip_special_tokens=True):
            return "".join(chr(97 + t % 26) for t in token_ids if t != 256)

    seen = {}

    def factory(config):
        seen["config"] = config
        return Letters()

    p = plugin("letters_plugin", register_tokenizers=lambda register: register("letters", factory))
    engine = Engine.from_config({**FAKE, "tokenizer": {"name": "letters"}}, extra_plugins=[p])
    assert seen["config"] is engine.config and isinstance(engine.tokenizer, Letters)
    engine.add_request(engine.tokenizer.encode("hello"), SamplingParams(max_tokens=6, ignore_eos=True),
                       request_id="x")
    ids, text = [], ""
    while engine.has_unfinished:
        for o in engine.step().outputs:
            ids += o.new_token_ids
            text += o.new_text
    assert len(ids) == 6
    assert text == Letters().decode(ids)  # the engine detokenized through the plugin's tokenizer


def test_hook_register_metric_sinks():
    class Recorder(MetricSink):
        def __init__(self, options):
            self.options, self.steps, self.requests, self.closed = options, [], [], False

        def on_step(self, metrics):
            self.steps.append(metrics)

        def on_request_finished(self, metrics):
            self.requests.append(metrics)

        def close(self):
            self.closed = True

    p = plugin("recorder_plugin",
               register_metric_sinks=lambda register: register("recorder", lambda config, options: Recorder(options)))
    engine = Engine.from_config({**FAKE, "metrics": {"sinks": [
        {"name": "recorder", "options": {"label": "a"}}, {"name": "recorder", "options": {"label": "b"}}]}},
        extra_plugins=[p])
    a, b = engine.metric_sinks
    assert (a.options, b.options) == ({"label": "a"}, {"label": "b"})  # one sink per entry, own options
    engine.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.shutdown()
    for sink in (a, b):
        assert sorted(m.num_prompt_tokens for m in sink.requests) == [2, 3]
        assert all(m.num_output_tokens == 3 and m.finish_reason == "length" for m in sink.requests)
        assert len(sink.steps) >= 3 and sink.steps[0].num_prefill_tokens == 5
        assert sink.closed


def test_hook_register_routes():
    from starlette.testclient import TestClient

    from llmserve.server import create_app

    seen = {}

    def register_routes(register, model, client):
        from starlette.responses import JSONResponse

        seen["model"], seen["client"] = model, client

        async def queue(request):
            return JSONResponse({"waiting": client.num_waiting, "active": client.num_active,
                                 "max_model_len": model.max_model_len, "scheduler": model.config.scheduler.name})

        register("/example/queue", queue, methods=("GET",))
        register("/stats", queue)  # clashes with a built-in route: skipped with a warning, not an override

    p = plugin("queue_plugin", register_routes=register_routes)
    engine = Engine.from_config(FAKE, extra_plugins=[p])
    app = create_app(engine.config, engine)
    with TestClient(app) as client:  # the lifespan attaches plugin routes
        # the route plugin gets what the built-in routes read: the ServingModel and the EngineClient
        assert seen["model"] is app.state.llm.model and seen["client"] is app.state.llm.client
        r = client.get("/example/queue")
        assert r.status_code == 200 and r.json() == {"waiting": 0, "active": 0, "max_model_len": engine.max_model_len,
                                                     "scheduler": "continuous"}
        assert client.post("/example/queue").status_code == 405  # only the methods it registered
        assert "scheduler" in client.get("/stats").json()  # the built-in /stats still answers
        assert client.get("/metrics").status_code == 200  # the default plugin's route is there too


def test_a_route_the_app_owner_set_takes_a_plugins_place_quietly(caplog):
    """A plugin's route at a path the app's owner took (the Ray ingress's fleet-wide /metrics) is skipped without the
    clash warning; a clash with a built-in route still warns."""
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from llmserve.server import create_app

    def register_routes(register, model, client):
        register("/metrics", lambda request: PlainTextResponse("the plugin's"))
        register("/stats", lambda request: PlainTextResponse("the plugin's"))

    engine = Engine.from_config(FAKE, extra_plugins=[plugin("clashing", register_routes=register_routes)])
    app = create_app(engine.config, engine)
    app.router.routes.append(Route("/metrics", lambda request: PlainTextResponse("the owner's")))
    app.state.llm.owned_paths.add("/metrics")
    with caplog.at_level(logging.WARNING, logger="llmserve.server"), TestClient(app) as client:
        assert client.get("/metrics").text == "the owner's"
    clashes = [r.getMessage() for r in caplog.records if "clashes" in r.getMessage()]
    assert clashes == ["a plugin route /stats clashes with an existing route; skipped"]


def test_hook_register_commands(site, capsys):
    from llmserve import cli

    site.add("hello", '''
        from llmserve.hookspecs import hookimpl

        @hookimpl
        def register_commands(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.add_argument("--name", default="world")
            p.set_defaults(func=lambda args: print(f"hello, {args.name}") or 3)
        ''')
    assert cli.main(["hello", "--name", "plugins"]) == 3  # the command's return value is the exit code
    assert capsys.readouterr().out == "hello, plugins\n"
    # the hook receives argparse subparsers
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    load_plugins().pm.hook.register_commands(subparsers=sub)
    assert parser.parse_args(["hello"]).name == "world"
