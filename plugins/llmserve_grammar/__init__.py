"""Default grammar engines for structured output: "llguidance" (the default) and "xgrammar" (when installed).

Options (structured_output.options): whitespace_flexible (default false: JSON is compact, as
small models given free whitespace tend to emit it forever); open_objects (default false: an object that names its
properties and says nothing of others takes no others, as llama.cpp's and xgrammar's converters have it; true: JSON
Schema's rule, any others).
"""

from __future__ import annotations

import importlib.util

from llmserve.config import check_options
from llmserve.errors import PluginError
from llmserve.hookspecs import hookimpl

_OPTIONS = {"whitespace_flexible": False, "open_objects": False}


def _llguidance(config, tokenizer, vocab_size):
    from llmserve_grammar.llg import LLGuidanceEngine

    opts = check_options(config.structured_output.options, _OPTIONS, f"{config.source}: structured_output.options")
    return LLGuidanceEngine(tokenizer, vocab_size, bool(opts["whitespace_flexible"]), bool(opts["open_objects"]))


def _xgrammar(config, tokenizer, vocab_size):
    opts = check_options(config.structured_output.options, _OPTIONS, f"{config.source}: structured_output.options")
    try:
        from llmserve_grammar.xgr import XGrammarEngine

        return XGrammarEngine(tokenizer, vocab_size, bool(opts["whitespace_flexible"]), bool(opts["open_objects"]))
    except ImportError as e:
        raise PluginError(f"structured_output.name 'xgrammar' needs the xgrammar package ({e}); "
                          "pip install xgrammar, or use 'llguidance'") from None


@hookimpl
def register_structured_output(register):
    """Register the llguidance engine, and the xgrammar one where its package is installed."""
    register("llguidance", _llguidance)
    if importlib.util.find_spec("xgrammar") is not None:  # (found, not imported: it imports torch and triton)
        register("xgrammar", _xgrammar)
