"""A mixer form and the node of a captured call (``spdsl.propagate.mixer_form``): one form
per name, a site that calls the function again on other tensors as the model called it, the
function behind a hub-kernel wrapper, and the node's fake output from the form."""

from __future__ import annotations

import pytest
import torch

from spdsl._torch import FakeTensorMode
from spdsl.propagate.mixer_form import (
    MIXERS,
    SITES,
    MixerForm,
    Role,
    add_site,
    bind,
    make_site,
    register_mixer,
    signed,
)


def _scan(hidden, gate, scale=2.0, *, reverse=False):
    out = hidden * gate.sigmoid() * scale
    return out.flip(1) if reverse else out


def _form(name: str) -> MixerForm:
    return MixerForm(name, (), roles={"hidden": Role(), "gate": Role()}, out=Role(),
                     output=lambda b: (tuple(b["hidden"].shape), torch.float64),
                     pack=lambda o: o, accepts=lambda b: True)


def test_one_form_per_name():
    form = _form("test_scan")
    try:
        assert register_mixer(form) is form and register_mixer(form) is form
        with pytest.raises(ValueError, match="test_scan"):
            register_mixer(_form("test_scan"))
    finally:
        MIXERS.pop("test_scan", None)


def test_a_site_calls_the_function_again_as_the_model_did():
    h, g = torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 3)
    bound = bind(_scan, (h,), {"gate": g, "reverse": True})
    assert list(bound) == ["hidden", "gate", "scale", "reverse"]
    site, tensors = make_site(_form("test_scan"), _scan, bound, positional=1)
    assert tensors == [h, g] and site.names == ["hidden", "gate"]
    assert site.shapes == [(1, 4, 2, 3)] * 2 and site.role(1) == Role()
    h2, g2 = h + 1, g - 1
    assert torch.equal(site.call([h2, g2]), _scan(h2, g2, reverse=True))
    assert torch.equal(site.call([h2, g2], scale=0.5), _scan(h2, g2, 0.5, reverse=True))
    assert bind(_scan, (h, g, 1.0, 2.0), {}) is None              # not a call of it


def test_the_node_computes_the_function_and_fakes_the_forms_output():
    h, g = torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 3)
    site, tensors = make_site(_form("test_scan"), _scan, bind(_scan, (h, g), {}))
    key = add_site(site)
    try:
        assert torch.equal(torch.ops.spdsl.mixer(tensors, key), _scan(h, g))
        with FakeTensorMode() as mode:
            out = torch.ops.spdsl.mixer([mode.from_tensor(t) for t in tensors], key)
        assert out.shape == h.shape and out.dtype == torch.float64
    finally:
        SITES.pop(key)


def test_a_hub_kernel_wrapper_binds_as_its_function():
    def make(func):
        class Wrapper(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)
        return Wrapper()
    wrapped = make(_scan)
    assert signed(wrapped) is _scan and signed(_scan) is _scan
    assert bind(wrapped, (torch.ones(1),), {"gate": torch.ones(1)})["scale"] == 2.0
