"""Short convolutions along the sequence written as ATen convolution (``nn.Conv1d``,
``F.conv1d``), as users write them: the model, and the cases the parity test runs on every
rank of one launch (``tests/parity/test_conv_parity.py``)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from tests.parity.cases import _errs, ran_and_planned

# (spelling, kernel, dilation, groups, bias): "slice" is nn.Conv1d(padding=d (k - 1)) then
# ``[..., :L]`` (as Hugging Face's torch causal_conv1d_fn); "pad" is F.pad(x, (d (k - 1), 0))
# then a convolution without padding; "same" is the symmetric padding kept whole
# (``padding=d (k - 1) / 2``), "same_str" ``padding="same"`` (an even kernel: one token more
# behind than in front)
LAYERS = (("slice", 4, 1, "depthwise", True),
          ("pad", 3, 1, "depthwise", True),
          ("pad", 3, 2, "depthwise", False),
          ("slice", 2, 1, "dense", True),
          ("same", 3, 1, 4, True),
          ("same_str", 4, 1, "depthwise", True))


class ConvNet(nn.Module):
    """Embedding, then one residual block per entry of ``layers`` (a convolution over the
    tokens, SiLU), then a linear head and the token-mean cross-entropy."""

    def __init__(self, layers=LAYERS, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.spec = layers
        self.emb = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList()
        for spelling, k, d, groups, bias in layers:
            groups = dim if groups == "depthwise" else 1 if groups == "dense" else groups
            pad = {"slice": d * (k - 1), "pad": 0, "same": d * (k - 1) // 2,
                   "same_str": "same"}[spelling]
            self.convs.append(nn.Conv1d(dim, dim, k, padding=pad, dilation=d, groups=groups,
                                        bias=bias))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)                                    # [B, L, C]
        L = x.shape[1]
        for (spelling, k, d, _g, _b), conv in zip(self.spec, self.convs):
            h = x.transpose(1, 2)                            # [B, C, L]
            if spelling == "slice":
                h = conv(h)[..., :L]
            elif spelling == "pad":
                h = conv(F.pad(h, (d * (k - 1), 0)))
            else:
                h = conv(h)
            x = x + F.silu(h.transpose(1, 2))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(b: int = 2, s: int = 64, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (b, s), generator=g),
            torch.randint(0, vocab, (b, s), generator=g))


def run_case(seq: int, length: int) -> dict:
    """``sp_shard(seq=seq)`` on this launch's ranks (a dp axis over the rest) against one
    device: loss and gradient errors, the strategy of each convolution, and the collectives
    one step ran against the plan's."""
    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    args = batch(s=length)
    loss_ref = ref(*args)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=seq)(model)
    loss = step(*args)
    loss.backward()
    out = _errs(model, ref, loss, loss_ref)
    plan = spdsl.plan(step, *args)
    out["strategies"] = [v.origin for v in plan.values if v.origin.startswith("mixer.")]
    out["ran"], out["planned"] = ran_and_planned(step, model, args)
    return out


# sp4_short: pieces of 4 tokens, as many as the dilated convolution reads before each output
CASES = {"sp4": (4, 64), "dp2_sp2": (2, 64), "sp4_short": (4, 16)}


def run_all(rank: int, world: int) -> dict:
    out = {}
    for name, (seq, length) in CASES.items():
        try:
            out[name] = run_case(seq, length)
        except Exception:  # noqa: BLE001 - reported per case
            import traceback
            out[name] = {"error": traceback.format_exc()}
    return out
