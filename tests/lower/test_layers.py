"""``spdsl.lower.layers.layer_of``: the layer of a module path."""

from __future__ import annotations

import pytest

from spdsl.lower.layers import layer_of


@pytest.mark.parametrize("path,layer", [
    ("layers.3.attention.wq", "layers.3"),
    ("model.layers.12.mlp", "model.layers.12"),
    ("layers.3", "layers.3"),
    ("h.0", "h.0"),
    ("model.layers.1.experts.7.w1", "model.layers.1"),      # the first number counts
    ("transformer.h10.attn", None),                         # a number inside a name is not one
    ("lm_head", None), ("", None), (None, None),
])
def test_layer_of(path, layer):
    assert layer_of(path) == layer
