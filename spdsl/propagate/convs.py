"""Short convolutions along the sequence, written as ATen convolution, become one ``conv1d``
mixer node (``spdsl.propagate.mixers``): split over the sequence with a halo exchange.

Hugging Face's ``causal_conv1d_fn`` is captured at its call; a model that writes the same
convolution itself is traced as ops::

    y = nn.Conv1d(C, C, k, groups=C, padding=k - 1)(x)[..., :L]        # symmetric pad, slice
    y = F.conv1d(F.pad(x, (k - 1, 0)), w, b, groups=C)                 # left pad, no padding

``aten.convolution`` has no sequence rule: the DTensor strategy the engine falls back to
gathered its input on every rank (LFM2's convolution traced as ops, SP 2, 2 x 64 tokens of 64
channels: a 16 KiB all-gather forward and another backward, against a 1 KiB halo). Yet output
``t`` of such a convolution reads the inputs ``t - a .. t + b`` only (``a + b = dilation *
(kernel - 1)``; the causal ones above: ``a = d (k - 1)``, ``b = 0``), so a rank holding tokens
``[lo, hi)`` computes its outputs from those and ``a`` tokens of the previous rank, ``b`` of the
next: a halo exchange of ``(a + b)`` tokens, zeros past the sequence's ends (the padding's
zeros).

Recognised: a 1-D ``aten.convolution`` (stride 1, any groups, dilation, bias) on ``x`` of
``L`` tokens, optionally after ``constant_pad_nd(x, [pl, pr], 0)`` (and slices that keep all of
it), whose output (optionally sliced along its length, step 1) has exactly ``L`` tokens: the
padding in front (``pl`` plus the convolution's own, less the slice's start) is ``a``. A
symmetric ``same`` convolution (``padding=d (k - 1) / 2``) is the case ``a = b``
(``padding="same"`` with an even kernel traces as a pad of one token more behind). Anything
else (a stride, an output shorter or longer than its input, another padding value or mode, a
convolution output read before its slice too) is left as traced: exact, gathered as before.
A pad that other ops read as well stays for them.

The node runs :func:`conv1d` (``F.pad`` then ``F.conv1d``, as one device computes it); its
state passing (``spdsl.lower.mixers``) exchanges the halo and runs it without padding.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from spdsl._torch import detect_fake_mode
from spdsl.propagate.mixer_form import MixerForm, Role, add_site, make_site, register_mixer

aten = torch.ops.aten


def conv1d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, before: int,
           after: int, dilation: int, groups: int) -> torch.Tensor:
    """``input`` ([B, C, L]) padded with ``before`` zeros in front and ``after`` behind, then
    convolved with stride 1: ``L + before + after - dilation * (kernel - 1)`` outputs.

    Example::

        conv1d(x, w, None, before=2, after=0, dilation=1, groups=C)   # causal, kernel 3
    """
    if before or after:
        input = F.pad(input, (before, after))
    return F.conv1d(input, weight, bias, dilation=dilation, groups=groups)


def _output(b: dict) -> tuple:
    x, w = b["input"], b["weight"]
    d = b["dilation"] * (w.shape[-1] - 1)
    return (x.shape[0], w.shape[0], x.shape[2] + b["before"] + b["after"] - d), x.dtype


def _halo_bytes(b: dict, parts: int) -> int:
    x = b["input"]
    return x.shape[0] * x.shape[1] * (b["before"] + b["after"]) * x.element_size()


# no heads strategy: a dense or grouped convolution mixes channels, and a short depthwise
# one's halo (B x C x (k - 1)) is always fewer bytes than the all-to-alls of its input and output
CONV1D = register_mixer(MixerForm(
    "conv1d", (),
    roles={"input": Role(seq=2, heads=None), "weight": Role(None, None, None),
           "bias": Role(None, None, None)},
    out=Role(seq=2, heads=None), output=_output, pack=lambda o: o, accepts=lambda b: True,
    state_bytes=_halo_bytes, exchange="halo", halo=lambda b: (b["before"], b["after"]),
    min_local=lambda b: max(1, b["before"], b["after"])))


def convs_as_mixers(gm: torch.fx.GraphModule) -> int:
    """Rewrite every convolution of the module docstring's shapes into a ``conv1d`` mixer
    node; the number rewritten."""
    done = sum(_rewrite(gm, n) for n in list(gm.graph.nodes)
               if n.target is aten.convolution.default)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _whole_slice(n: torch.fx.Node) -> bool:
    """A step-1 slice that keeps everything (``x[..., -(p + L):]`` of ``p + L`` tokens)."""
    if n.target is not aten.slice.Tensor or (len(n.args) > 4 and n.args[4] != 1):
        return False
    return tuple(n.meta["val"].shape) == tuple(n.args[0].meta["val"].shape)


def _source(x: torch.fx.Node) -> tuple[torch.fx.Node, int, int]:
    """(the unpadded input, zeros in front, zeros behind) of a convolution's input ``x``."""
    while _whole_slice(x):
        x = x.args[0]
    if x.target is not aten.constant_pad_nd.default:
        return x, 0, 0
    pad = list(x.args[1])
    value = x.args[2] if len(x.args) > 2 else x.kwargs.get("value", 0)
    if len(pad) < 2 or any(pad[2:]) or min(pad[:2]) < 0 or value != 0:
        return x, 0, 0
    src = x.args[0]
    while _whole_slice(src):
        src = src.args[0]
    return src, pad[0], pad[1]


def _rewrite(gm: torch.fx.GraphModule, conv: torch.fx.Node) -> int:
    a = list(conv.args) + [None] * (9 - len(conv.args))
    x, w, bias, stride, padding, dilation, transposed, _out_pad, groups = a[:9]
    out = conv.meta.get("val")
    if transposed or out is None or out.dim() != 3 or list(stride) != [1] or \
            len(padding) != 1 or len(dilation) != 1:
        return 0
    src, front, back = _source(x)
    length = src.meta["val"].shape[2] if src.meta["val"].dim() == 3 else -1
    end, start = conv, 0
    if len(conv.users) == 1:
        (user,) = conv.users
        if user.target is aten.slice.Tensor and user.args[0] is conv and \
                len(user.args) > 1 and user.args[1] % 3 == 2 and \
                (len(user.args) < 5 or user.args[4] == 1):
            sa = list(user.args) + [None] * (5 - len(user.args))
            start = sa[2] or 0
            start = max(0, start + out.shape[2]) if start < 0 else min(start, out.shape[2])
            end = user
    if end.meta["val"].shape[2] != length:
        return 0
    reach = dilation[0] * (w.meta["val"].shape[-1] - 1)
    before = front + padding[0] - start
    after = reach - before
    if before < 0 or after < 0:
        return 0
    bound = {"input": src.meta["val"], "weight": w.meta["val"],
             "bias": bias.meta["val"] if isinstance(bias, torch.fx.Node) else None,
             "before": before, "after": after, "dilation": dilation[0], "groups": groups}
    site, vals = make_site(CONV1D, conv1d, bound)
    key = add_site(site)
    nodes = [src, w] + ([bias] if isinstance(bias, torch.fx.Node) else [])
    g = gm.graph
    with g.inserting_before(conv):
        node = g.call_function(torch.ops.spdsl.mixer.default, (nodes, key))
    with detect_fake_mode(vals) or contextlib.nullcontext():
        node.meta["val"] = torch.ops.spdsl.mixer.default(vals, key)
    node.meta.update({k: conv.meta[k] for k in ("stack_trace", "spdsl_module", "nn_module_stack")
                      if k in conv.meta})
    end.replace_all_uses_with(node)
    # what only the convolution read: its slice, itself, its pad and the pad's slices
    dead = [end, conv] if end is not conv else [conv]
    dead += _chain(x, src)
    for n in dead:
        if not n.users:
            g.erase_node(n)
    return 1


def _chain(x: torch.fx.Node, src: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from the convolution's input back to (not including) ``src``."""
    out = []
    while x is not src:
        out.append(x)
        x = x.args[0]
    return out
