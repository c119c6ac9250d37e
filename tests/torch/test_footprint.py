"""describe()'s weight_bytes / matmul_params / kv_bytes_per_token against sizes counted from the state dict."""

from __future__ import annotations

import pytest
import torch

from torch_helpers import make_backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("linear", ["torch", "onednn"])
def test_embedded_model(dtype, linear):
    from llmserve.config import ModelConfig
    from llmserve_torch import embedded
    from llmserve_torch.models.common import onednn_available
    from llmserve_torch.sources import find_source

    if linear == "onednn" and not onednn_available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip("no oneDNN packed linear for this dtype on this CPU / torch build")
    b = make_backend("embedded", dtype=dtype, linear=linear)
    d = b.describe()
    # a step reads the four linears of each layer (weights and biases) and the LM head tied to wte; not wpe, not
    # the LayerNorms
    sd = find_source("embedded").load(ModelConfig(model="embedded")).state_dict
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    read = [n for n in sd if n == "wte.weight" or ".attn.c_" in n or ".mlp.c_" in n]
    assert len(read) == 1 + 4 * 2 * embedded.config_dict()["n_layer"]
    assert d["weight_bytes"] == sum(sd[n].numel() for n in read) * elem
    assert d["matmul_params"] == sum(sd[n].numel() for n in read if sd[n].dim() == 2)
    a = embedded.arch()
    assert d["kv_bytes_per_token"] == 2 * a.num_layers * a.hidden_size * elem
    assert len(b.model.linears()) == 4 * a.num_layers + 1


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_counts_the_head_and_not_the_embedding(tied, qwen2_dir, qwen2_tied_dir):
    d_, hf = qwen2_tied_dir if tied else qwen2_dir
    d = make_backend(str(d_)).describe()
    sd = hf.state_dict()
    c = hf.config
    proj = sum(t.numel() for n, t in sd.items() if "_proj." in n) * 4
    head = c.vocab_size * c.hidden_size * 4  # the LM head, counted once whether or not it is the embedding
    assert d["weight_bytes"] == proj + head
