"""The model-family registry (models/family.py): what it serves, refusals that list it, and a plugin's family taking a
model type over through register_family, the way docs/backend-torch.md tells a third-party plugin to."""

from __future__ import annotations

import pytest
from torch_helpers import make_backend

from llmserve.errors import ConfigError
from llmserve_torch.models import decoder
from llmserve_torch.models.family import (
    arch_from_hf,
    family_of,
    gguf_archs,
    model_types,
    register_family,
    unregister_family,
)


def test_every_built_in_family_is_registered():
    assert model_types() == ["bert", "gemma", "gpt2", "llama", "mistral", "qwen2", "qwen3"]
    assert gguf_archs() == ["gemma", "gpt2", "llama", "qwen2", "qwen3"]


def test_an_unknown_model_type_lists_the_supported_ones():
    class Config:
        model_type = "mamba"

    with pytest.raises(ConfigError, match=r"model type 'mamba' is not supported by the torch backend \(supported: "
                                          r"bert, gemma, gpt2, llama, mistral, qwen2, qwen3\)"):
        arch_from_hf(Config())


class _PluginDecoder(decoder.DecoderFamily):
    """A plugin's family: the decoder's model, built by the plugin (it counts its builds)."""

    name = "plugin-decoder"
    model_types = ("qwen2",)
    gguf_archs = ()
    builds = 0

    def build(self, arch, sd, make, max_len, ops):
        type(self).builds += 1
        return super().build(arch, sd, make, max_len, ops)


def test_a_plugin_family_takes_a_model_type_over_only_when_it_says_so(qwen2_dir):
    plugin = _PluginDecoder()
    with pytest.raises(ValueError, match=r"model family 'plugin-decoder': qwen2 already registered"):
        register_family(plugin)
    register_family(plugin, replace=True)
    try:
        b = make_backend(str(qwen2_dir[0]))
        assert (b.arch.family, family_of(b.arch), _PluginDecoder.builds) == ("plugin-decoder", plugin, 1)
        assert b.describe()["model_type"] == "qwen2"
    finally:
        unregister_family(plugin)
        register_family(decoder.FAMILY, replace=True)
    assert make_backend(str(qwen2_dir[0])).arch.family == "decoder" and _PluginDecoder.builds == 1
