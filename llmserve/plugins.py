"""The plugin manager: default plugins first, then third-party entry points, each isolated.

Each Engine builds its own manager (``load_plugins()``), so nothing global needs undoing in
tests; a command shares one while it runs (``loaded_once``). A component is picked by name
from the registries the ``register_*`` hooks fill.
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from llmserve import hookspecs
from llmserve.errors import PluginError

log = logging.getLogger("llmserve.plugins")

ENTRY_POINT_GROUP = "llmserve"

# Built-in plugins: ordinary modules under plugins/, registered through the same hooks a
# third-party package implements. The core names them only here, as strings.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "llmserve_scheduler",
    "llmserve_paged_cache",
    "llmserve_fake",
    "llmserve_torch",
    "llmserve_grpc",
    "llmserve_onnx",
    "llmserve_tokenizers",
    "llmserve_jsonl",
    "llmserve_prometheus",
    "llmserve_grammar",
    "llmserve_bench",
    "llmserve_tools",
    "llmserve_ui",
    "llmserve_generate",
    "llmserve_anthropic",
    "llmserve_embeddings",
    "llmserve_responses",
    "llmserve_responses_sqlite",
    "llmserve_ray",
)

# registry kind → the hook that fills it
COMPONENT_HOOKS: dict[str, str] = {
    "backend": "register_backends",
    "scheduler": "register_schedulers",
    "cache": "register_cache_allocators",
    "tokenizer": "register_tokenizers",
    "metric_sink": "register_metric_sinks",
    "grammar": "register_structured_output",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "router": "register_routers",
    "launcher": "register_launchers",
    "response_store": "register_response_stores",
}


@dataclass(slots=True)
class Registration:
    name: str
    factory: Callable[..., Any]
    plugin: str  # the plugin that registered it


@dataclass
class PluginSet:
    """A loaded plugin manager with the components its plugins registered."""

    pm: pluggy.PluginManager
    registries: dict[str, dict[str, Registration]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # plugin name → error text
    sources: dict[str, str] = field(default_factory=dict)  # plugin name → "default" | dist name

    def get(self, kind: str, name: str) -> Registration:
        """The registration of component `name` of `kind`, or a PluginError listing the choices."""
        reg = self.registries[kind].get(name)
        if reg is None:
            have = ", ".join(sorted(self.registries[kind])) or "none"
            raise PluginError(f"no {kind.replace('_', ' ')} named {name!r} is registered (available: {have})")
        return reg

    def describe(self) -> list[dict[str, Any]]:
        """One entry per plugin: its name, source, hooks and components (for `llmserve plugins`)."""
        out = []
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda kv: kv[0]):
            comps = {kind: sorted(r.name for r in reg.values() if r.plugin == name)
                     for kind, reg in self.registries.items()}
            out.append({"name": name, "source": self.sources.get(name, "registered"),
                        "hooks": sorted(h.name for h in self.pm.get_hookcallers(plugin) or []),
                        "components": {k: v for k, v in comps.items() if v}})
        for name, err in sorted(self.failed.items()):
            out.append({"name": name, "source": self.sources.get(name, "entry point"), "hooks": [],
                        "components": {}, "error": err})
        return out


# the set (or the error) of the command running in this process, inside loaded_once()
_command_set: PluginSet | PluginError | None = None


@contextmanager
def loaded_once() -> Iterator[None]:
    """Load the plugins once for a command: inside, load_plugins() with default arguments returns that set."""
    global _command_set
    try:
        _command_set = load_plugins()
    except PluginError as e:  # raised again, by the first thing that needs plugins
        _command_set = e
    try:
        yield
    finally:
        _command_set = None


def load_plugins(extra_plugins: list[Any] | None = None, defaults: tuple[str, ...] = DEFAULT_PLUGINS,
                 entry_points: bool = True) -> PluginSet:
    """Build a fresh plugin manager: defaults, then entry points, then `extra_plugins` objects.

    A third-party plugin that raises while loading is logged by name and skipped (fatal with
    LLMSERVE_STRICT_PLUGINS=1). LLMSERVE_PLUGINS=a,b loads only the named entry points.
    Misspelled hooks fail here via pluggy's check_pending(). Inside loaded_once(), a call with the
    default arguments (Engine.from_config's) gets the command's set rather than logging every error again.
    """
    if _command_set is not None and not extra_plugins and defaults == DEFAULT_PLUGINS and entry_points:
        if isinstance(_command_set, PluginError):
            raise _command_set
        return _command_set
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    ps = PluginSet(pm=pm)

    for modname in defaults:
        ps.sources[modname] = "default"
        try:
            pm.register(importlib.import_module(modname), name=modname)
        except ImportError as e:
            # a default plugin whose optional dependency is missing is reported, not fatal
            ps.failed[modname] = f"{type(e).__name__}: {e}"
            log.warning("default plugin %s not loaded: %s", modname, e)

    if entry_points:
        raw = os.environ.get("LLMSERVE_PLUGINS")
        allowed = None if raw is None else {p.strip() for p in raw.split(",")}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (allowed is not None and ep.name not in allowed) or pm.has_plugin(ep.name) or ep.name in ps.failed:
                continue  # not asked for, or the same distribution seen twice on sys.path
            dist = getattr(ep, "dist", None)
            ps.sources[ep.name] = f"entry point ({dist.name} {dist.version})" if dist else "entry point"
            try:
                pm.register(ep.load(), name=ep.name)
            except pluggy.PluginValidationError as e:
                # it loaded, but a hookimpl does not match its spec: a bug to fix, never skipped
                raise PluginError(f"plugin {ep.name!r} ({ep.value}): {e}") from e
            except Exception as e:
                msg = f"plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}"
                if os.environ.get("LLMSERVE_STRICT_PLUGINS", "") not in ("", "0", "false", "no"):
                    raise PluginError(msg + " [LLMSERVE_STRICT_PLUGINS is set]") from e
                ps.failed[ep.name] = f"{type(e).__name__}: {e}"
                log.error("%s; skipped (set LLMSERVE_STRICT_PLUGINS=1 to make this fatal)\n%s",
                          msg, traceback.format_exc(limit=3))

    for plugin in extra_plugins or []:
        if pm.is_registered(plugin):
            continue  # already loaded through its entry point (a plugin's own tests do this)
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {name!r}: {e}") from e
        ps.sources[name] = "registered"

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {e.plugin!r}: {e}") from e

    for kind, hook_name in COMPONENT_HOOKS.items():
        ps.registries[kind] = _collect(pm, kind, hook_name)
    return ps


def _collect(pm: pluggy.PluginManager, kind: str, hook_name: str) -> dict[str, Registration]:
    """Call one register_* hook on every plugin, remembering which plugin registered what."""
    registry: dict[str, Registration] = {}
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():  # registration order: defaults first, then entry points
        plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)

        def register(name: str, factory: Callable[..., Any], _plugin: str = plugin_name) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"plugin {_plugin!r} registered a {kind} with an invalid name {name!r}")
            if name in registry:
                raise PluginError(f"two plugins register a {kind.replace('_', ' ')} named {name!r}: "
                                  f"{registry[name].plugin!r} and {_plugin!r}; uninstall one or limit loading "
                                  "with LLMSERVE_PLUGINS")
            registry[name] = Registration(name, factory, _plugin)

        try:
            impl.function(register)
        except PluginError:
            raise
        except Exception as e:
            raise PluginError(f"plugin {plugin_name!r} failed in {hook_name}: {type(e).__name__}: {e}") from e
    return registry
