"""Parity cases run on every rank of one launch: each returns the loss and per-parameter
gradient errors of the sequence-parallel run against single-device PyTorch on the same
weights and batch (fp32)."""

from __future__ import annotations

import collections
import copy
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl import P
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.models.toys import EinopsNet, GPT2Like, MeanPoolClassifier


def _errs(model: nn.Module, ref: nn.Module, loss, loss_ref) -> dict:
    """Loss and per-parameter gradient errors; sharded gradients (DTensor) are gathered."""
    from torch.distributed.tensor import DTensor
    out = {"loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
           "loss_value": loss.item(), "grad": 0.0, "n_grads": 0, "missing": [], "extra": []}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if q.grad is None:
            if g is not None:
                out["extra"].append(name)
            continue
        if g is None:
            out["missing"].append(name)
            continue
        scale = q.grad.abs().max().item() or 1.0
        out["grad"] = max(out["grad"], (g - q.grad).abs().max().item() / scale)
        out["n_grads"] += 1
    return out


def _pair(make):
    torch.manual_seed(0)
    ref = make()
    return ref, copy.deepcopy(ref)


def _run(make, args, world, **kw):
    ref, model = _pair(make)
    loss_ref = ref(*args)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=world, **kw)(model)
    loss = step(*args)
    loss.backward()
    out = _errs(model, ref, loss, loss_ref)
    if world > 1:
        out["ran"], out["planned"] = ran_and_planned(step, model, args)
    return out


# process-group event names (``c10d::<name>_``) -> the plan's collective kinds
PG_KINDS = {"alltoall_base": "all_to_all", "allreduce": "all_reduce",
            "allgather_into_tensor_coalesced": "all_gather", "_allgather_base": "all_gather",
            "allgather": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter",
            "_reduce_scatter_base": "reduce_scatter"}
# the gloo backend's record for each process-group call (a reduce-scatter runs as an all-reduce)
GLOO_OF = {"alltoall_base": "all_to_all", "allreduce": "all_reduce",
           "allgather_into_tensor_coalesced": "all_gather", "_allgather_base": "all_gather",
           "allgather": "all_gather", "reduce_scatter_tensor_coalesced": "all_reduce",
           "_reduce_scatter_base": "all_reduce"}
ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "bool": 1}


def pg_calls(prof) -> list[tuple[str, int]]:
    """``(name, elements)`` of each process-group call in a profile: ``name`` as the
    ``c10d::<name>_`` record has it. The size comes from that record where it has one
    (all-to-all, all-gather and reduce-scatter into a tensor) or else from a gloo backend record
    of the matching kind (gloo runs a reduce-scatter as an all-reduce). Gloo records run on
    worker threads, so an asynchronous call (a gradient bucket reduced during backward) may
    finish after the next one is issued: records are matched by kind and size, never by
    adjacency. A gloo record left unmatched comes back as ``("unmatched gloo:<kind>", n)``,
    which no plan lists; a call left without one has ``n = -1``."""
    calls, gloo = [], {}
    for e in prof.events():
        if e.name.startswith("c10d::"):
            name = e.name.removeprefix("c10d::").rstrip("_")
            shapes = e.input_shapes or []
            own = math.prod(shapes[1]) if len(shapes) > 1 and shapes[1] else None
            calls.append((name, GLOO_OF.get(name, name), own))
        elif e.name.startswith("gloo:"):
            shape = e.input_shapes[0] if e.input_shapes and e.input_shapes[0] else []
            gloo.setdefault(e.name.removeprefix("gloo:"), []).append(math.prod(shape))
    for _name, pool, own in calls:      # sized by their own record: take that gloo record
        if own is not None and own in gloo.get(pool, []):
            gloo[pool].remove(own)
    out = []
    for name, pool, own in calls:       # the rest: the next gloo record of their kind
        if own is None:
            left = gloo.get(pool, [])
            own = left.pop(0) if left else -1
        out.append((name, own))
    return out + [(f"unmatched gloo:{pool}", n) for pool, sizes in gloo.items() for n in sizes]


def counted(fn) -> list[tuple[str, int]]:
    """``(kind, elements)`` of each process-group collective ``fn()`` runs (:func:`pg_calls`),
    kinds as the plan names them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    return [(PG_KINDS.get(name, name), n) for name, n in pg_calls(prof)]


def ran_and_planned(step, model, args, loss_of=None) -> tuple[list, list]:
    """The collectives one training step really ran (:func:`counted`): ``(kind, elements)``
    per call; and the plan's list: ``(kind, purpose, elements forward, elements backward)``
    per collective. ``loss_of(outputs)``: the scalar to differentiate, when the step does not
    return one."""
    model.zero_grad(set_to_none=True)

    def one() -> None:
        out = step(*args)
        (out if loss_of is None else loss_of(out)).backward()
    ran = counted(one)
    plan = spdsl.plan(step, *args)
    planned = []
    for c in plan.collectives:
        size = ITEMSIZE[c.values[0].lstrip("(").split("[")[0]]    # a tuple: its first
        planned.append((c.kind, c.purpose, c.bytes // size, c.bytes_bwd // size))
    return ran, planned


def _ids(b: int, s: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)


def _uneven_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    s = ids.shape[1]
    labels[0, : 3 * s // 4] = -100        # batch 0: only the last quarter is valid
    labels[1, s // 8: s // 2] = -100
    return labels


class EinsumNet(nn.Module):
    """A model written the way a new user might: einsum attention, chunked qkv, a triu mask
    of -inf, a learned scale, residual scaling, mean-of-squares auxiliary term, and a
    temperature read through ``.detach()`` (a parameter that must end with no gradient)."""

    def __init__(self, vocab: int = 256, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.ones(dim))
        self.temp = nn.Parameter(torch.tensor(1.0))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1]) + mask
        att = att / self.temp.detach()
        y = torch.einsum("bhqk,bhkd->bhqd", att.softmax(-1), v)
        y = y.permute(0, 2, 1, 3).reshape(b, s, -1)
        x = x + 0.5 * self.proj(y) * self.gain
        logits = self.head(F.silu(x))
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return ce + 1e-3 * x.pow(2).mean()


class OddOps(nn.Module):
    """Ops spdsl has no rule of its own for (DTensor's strategies apply): flip, pad, roll
    along the sequence, cumsum, plus an MSE loss over every element."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.flip(self.lin(x), dims=[2])
        h = F.pad(h, (0, 2))
        h = torch.roll(h, 1, dims=1) + h.cumsum(-1)
        return F.mse_loss(h[..., :-2], y)


def case_dtensor_rule_ops(world: int) -> dict:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 4 * world, 8, generator=g), torch.randn(2, 4 * world, 8, generator=g)
    return _run(OddOps, (x, y), world)


def case_llama(world: int) -> dict:
    ids = _ids(2, 64)
    return _run(lambda: Llama(LlamaConfig.tiny()), (ids, _uneven_labels(ids)), world)


def case_llama_gqa_kv1(world: int) -> dict:
    ids = _ids(2, 32)
    cfg = LlamaConfig.tiny().replace(n_kv_heads=1)
    return _run(lambda: Llama(cfg), (ids, ids), world)


def case_llama_tied(world: int) -> dict:
    ids = _ids(1, 32)
    cfg = LlamaConfig.tiny().replace(tie_embeddings=True, n_layers=1)
    return _run(lambda: Llama(cfg), (ids, ids), world)


def case_gpt2_eager_softmax(world: int) -> dict:
    ids = _ids(2, 32)
    return _run(lambda: GPT2Like(GPT2Like.Config()), (ids, _uneven_labels(ids)), world)


def case_einops_bool_tril(world: int) -> dict:
    ids = _ids(2, 33)
    return _run(lambda: EinopsNet(EinopsNet.Config()), (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), world)


def case_meanpool(world: int) -> dict:
    ids = _ids(3, 16)
    cls = torch.tensor([1, 0, 1])
    return _run(lambda: MeanPoolClassifier(MeanPoolClassifier.Config()), (ids, cls), world)


def case_repeat_kv(world: int) -> dict:
    """Grouped kv heads repeated the Hugging Face way before SDPA (crossing the all-to-all
    unrepeated)."""
    from tests.propagate.test_plan_repeat_kv import Stack
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8 * world, 64, generator=g)
    return _run(lambda: Stack(64, 4, 2, 2), (x,), world)


class SingleKV(nn.Module):
    """Multi-query attention written with the one kv head broadcast to every query head by
    ``expand`` (or tiled by ``repeat``) before SDPA: it crosses the all-to-all unbroadcast."""

    def __init__(self, how: str, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.how, self.h, self.d = how, heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 1, self.d).permute(2, 0, 3, 1, 4)
        if self.how == "expand":
            k, v = k.expand(b, self.h, s, self.d), v.expand(b, self.h, s, self.d)
        else:
            k, v = k.repeat(1, self.h, 1, 1), v.repeat(1, self.h, 1, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).mean()


def case_single_kv(world: int) -> dict:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8 * world, 64, generator=g)
    out = {}
    for how in ("expand", "repeat"):
        out[how] = _run(functools.partial(SingleKV, how), (x,), world)
        if world > 1:
            plan = spdsl.plan(spdsl.sp_shard(seq=world)(SingleKV(how)), x)
            out[how]["a2a_bytes"] = sum(c.bytes for c in plan.collectives
                                        if c.kind == "all_to_all")
    return out


class PartialToShard(nn.Module):
    """A sum over the sequence (a partial sum on every rank) constrained to be split over
    its features: one reduce-scatter, whose backward all-gathers."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = spdsl.with_sharding_constraint(self.w(x.sum(1)), P(None, "sp"))
        return (y * y).sum()


class TailSlice(nn.Module):
    """A slice of the split sequence taken from its end (``h[:, -(S - 2):]``): a halo exchange
    of rows between ranks, forward and back."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w(x)
        return h[:, -(x.shape[1] - 2):].pow(2).mean()


class FlexBlock(nn.Module):
    """Attention by ``flex_attention``: packed documents (a causal document BlockMask, its
    document ids a captured tensor), ALiBi slopes indexed by the head in ``score_mod``,
    grouped kv heads; or, ``per_head``, a BlockMask with one sliding window per head."""

    def __init__(self, seq: int, per_head: bool, dim: int, heads: int, kv_heads: int) -> None:
        from torch.nn.attention.flex_attention import create_block_mask
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        doc = torch.arange(seq) * 3 // seq                   # three packed documents
        slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)
        window = 4 + 4 * torch.arange(heads)                 # head h sees 4(h+1) keys back

        def document(b, h, q, k):
            return (doc[q] == doc[k]) & (q >= k)

        def sliding(b, h, q, k):
            return (q >= k) & (q - k < window[h])

        self.score_mod = None if per_head else (
            lambda score, b, h, q, k: score - slopes[h] * (q - k))
        self.block_mask = create_block_mask(sliding if per_head else document, B=None,
                                            H=heads if per_head else None, Q_LEN=seq,
                                            KV_LEN=seq, device="cpu", BLOCK_SIZE=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2, self.hk, self.d).permute(2, 0, 3, 1, 4)
        o = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask,
                           enable_gqa=True)
        return x + self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FlexNet(nn.Module):
    def __init__(self, seq: int, per_head: bool = False, vocab: int = 64, dim: int = 32,
                 heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([FlexBlock(seq, per_head, dim, heads, kv_heads)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class OutputReshard(nn.Module):
    """Outputs redistributed to their out_specs: a sequence-split value returned split on its
    features (an all-to-all, and one back in backward) and a sum over the sequence (a partial
    sum) returned split on its features (a reduce-scatter, an all-gather back)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.w(x)
        return y, y.sum(1)


def _squares(outs) -> torch.Tensor:
    """sum of squares of every output; of DTensors, of this rank's piece (the pieces add up)"""
    from torch.distributed.tensor import DTensor
    return sum((o.to_local() if isinstance(o, DTensor) else o).pow(2).sum() for o in outs)


class InputGradient(nn.Module):
    """A float input the caller wants the gradient of (the global tensor's whole gradient)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x)      # held as a parameter only to compare gradients
        self.lin = nn.Linear(x.shape[-1], x.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) ** 2).mean()


def case_partial_to_shard(world: int) -> dict:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4 * world, 4 * world, generator=g)
    return _run(lambda: PartialToShard(4 * world), (x,), world)


def case_tail_slice(world: int) -> dict:
    g = torch.Generator().manual_seed(10)
    return _run(lambda: TailSlice(8), (torch.randn(2, 4 * world, 8, generator=g),), world)


def case_flex(world: int) -> dict:
    """flex_attention under sp_shard, against the same model on one rank (both on CPU: the
    check that stops flex_attention's backward there is lifted for both, the eager math
    runs the same)."""
    from spdsl._torch import flex_attention_on_cpu

    out = {}
    for name, per_head, remat in (("document", False, "auto"), ("per_head", True, "auto"),
                                  ("document_remat_full", False, "full")):
        seq = 16 * world
        ids = _ids(2, seq, vocab=64)
        labels = torch.roll(ids, -1, dims=1)
        ref, model = _pair(functools.partial(FlexNet, seq, per_head))
        with flex_attention_on_cpu():
            loss_ref = ref(ids, labels)
            loss_ref.backward()
        step = spdsl.sp_shard(seq=world, remat=remat)(model)
        loss = step(ids, labels)
        loss.backward()
        res = _errs(model, ref, loss, loss_ref)
        local = step.prepare(ids, labels).local
        res["checkpointed"] = sum(type(m).__name__ == "Checkpointed" for m in local.modules())
        if world > 1:
            res["ran"], res["planned"] = ran_and_planned(step, model, (ids, labels))
        out[name] = res
    return out


def case_output_reshard(world: int) -> dict:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4 * world, 4 * world, generator=g)
    ref, model = _pair(lambda: OutputReshard(4 * world))
    loss_ref = _squares(ref(x))
    loss_ref.backward()
    step = spdsl.shard(model, mesh=spdsl.mesh(sp=world), in_specs=(P(None, "sp", None),),
                       out_specs=(P(None, None, "sp"), P(None, "sp")))
    outs = step(x)
    out = {"placements": [repr(o.placements) for o in outs]}
    local = _squares(outs)
    local.backward()
    loss = local.detach().clone()
    dist.all_reduce(loss)                # the rank pieces' sum: the global sum of squares
    out.update(_errs(model, ref, loss, loss_ref))
    if world > 1:
        out["ran"], out["planned"] = ran_and_planned(step, model, (x,), _squares)
    return out


def case_input_gradient(world: int) -> dict:
    """``x.grad`` of a global input split by ``sp_shard``: the whole gradient on every rank."""
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(2, 4 * world, 8, generator=g)
    ref, model = _pair(lambda: InputGradient(x0))
    x_ref, x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    loss_ref = ref(x_ref)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=world)(model)
    loss = step(x)
    loss.backward()
    ref.x.grad = x_ref.grad          # compared as the gradient of the model's first "parameter"
    model.x.grad = x.grad
    out = _errs(model, ref, loss, loss_ref)
    if world > 1:
        x.grad = None
        out["ran"], out["planned"] = ran_and_planned(step, model, (x,))
    return out


class FlashKernelNet(nn.Module):
    """A model that calls spdsl's flash kernel itself (causal, GQA): the kernel form."""

    def __init__(self, dim: int = 32, hq: int = 4, hkv: int = 2) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, dim // hq
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * hkv * self.d)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from spdsl.kernels import flash_attn
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        y = flash_attn(q, k, v, causal=True).transpose(1, 2).reshape(B, S, -1)
        return self.o(y).pow(2).mean()


def case_flash_kernel(world: int) -> dict:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 8 * world, 32, generator=g)
    return _run(FlashKernelNet, (x,), world)


def case_upcast_attention(world: int) -> dict:
    """q, k, v upcast to float64 right before attention, the output cast back: the exchanges
    move float32, each rank attends in float64."""
    from tests.propagate.test_plan_casts import UpcastAttention
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 8 * world, 64, generator=g)
    return _run(lambda: UpcastAttention(torch.float32, torch.float64, heads=4 * world, kv=world),
                (x,), world)


def case_einsum_user_model(world: int) -> dict:
    ids = _ids(2, 16)
    return _run(lambda: EinsumNet(), (ids, _uneven_labels(ids)), world)


def case_forward_replaced(world: int) -> dict:
    """``model.forward = sp_shard(...)(model.forward)``; the module is then called as usual."""
    ref, model = _pair(lambda: Llama(LlamaConfig.tiny().replace(n_layers=1)))
    model.forward = spdsl.sp_shard(seq=world)(model.forward)
    ids = _ids(2, 16)
    loss_ref = ref(ids, _uneven_labels(ids))
    loss_ref.backward()
    loss = model(ids, _uneven_labels(ids))
    loss.backward()
    return _errs(model, ref, loss, loss_ref)


def case_sgd_steps(world: int) -> dict:
    ref, model = _pair(lambda: Llama(LlamaConfig.tiny()))
    step = spdsl.sp_shard(seq=world)(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i in range(4):
        ids = _ids(2, 32, seed=10 + i)
        opt_ref.zero_grad()
        opt.zero_grad()
        lr_, l_ = ref(ids, ids), step(ids, ids)
        lr_.backward()
        l_.backward()
        opt_ref.step()
        opt.step()
        losses.append(abs(l_.item() - lr_.item()) / lr_.item())
    param = max((p - q).abs().max().item() / q.abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    return {"loss": max(losses), "param": param, "first": losses[0], "last_loss": l_.item()}


def case_shard_specs(world: int) -> dict:
    """The functional form with explicit specs and a constraint inside."""
    ref, model = _pair(lambda: Llama(LlamaConfig.tiny().replace(n_layers=1)))

    def loss_fn(ids, labels):
        h = model.tok_embeddings(ids)
        h = spdsl.with_sharding_constraint(h, P(None, "sp", None))
        logits = model.lm_head(model.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def ref_fn(ids, labels):
        logits = ref.lm_head(ref.norm(ref.tok_embeddings(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    ids = _ids(2, 16)
    mesh = spdsl.mesh(sp=world)
    step = spdsl.shard(loss_fn, mesh=mesh, in_specs=(P(None, "sp"), P(None, "sp")),
                       out_specs=P())
    loss_ref = ref_fn(ids, ids)
    loss_ref.backward()
    loss = step(ids, ids)
    loss.backward()
    return _errs(model, ref, loss, loss_ref)


def case_logits_dtensor(world: int) -> dict:
    """Sequence-shaped outputs come back as DTensors split on the sequence."""
    ref, model = _pair(lambda: Llama(LlamaConfig.tiny().replace(n_layers=1)))
    ids = _ids(2, 32)
    out = spdsl.sp_shard(seq=world)(model)(ids)
    full = out.full_tensor()
    want = ref(ids)
    return {"fwd": ((full - want).abs().max() / want.abs().max()).item(),
            "placements": repr(out.placements), "local": tuple(out.to_local().shape)}


def case_collectives(world: int) -> dict:
    """The collectives against global slicing, forward and backward, odd layouts included."""
    import torch.distributed as dist

    from spdsl import collectives as C
    from spdsl.propagate.placement import chunk_bounds

    rank = dist.get_rank()
    group = dist.group.WORLD.group_name
    errs = {}
    g = torch.Generator().manual_seed(0)

    def check(name, got, want):
        errs[name] = (got - want).abs().max().item() if got.shape == want.shape else float("inf")

    # all-to-all: [B, H, S@, D] -> [B, H@, S, D], and merged [B*S@, H*D] -> [B*S, H@*D]
    X = torch.randn(2, 4 * world, 4 * world, 3, generator=g, requires_grad=True)
    c = X.shape[2] // world
    local = X[:, :, rank * c:(rank + 1) * c].detach().requires_grad_()
    out = C.all_to_all(local, (2, 1), (1, 1), world, group)
    h = X.shape[1] // world
    check("a2a_fwd", out, X[:, rank * h:(rank + 1) * h].detach())
    W = torch.randn(out.shape, generator=g)
    (out * W).sum().backward()
    # the gradient of the local input is W moved back by the inverse all-to-all
    back = C.all_to_all(W, (1, 1), (2, 1), world, group)
    check("a2a_bwd", local.grad, back)
    check("a2a_roundtrip", C.all_to_all(out.detach(), (1, 1), (2, 1), world, group),
          local.detach())
    # merged dims: [B*S, E] split on S inside (outer=B) -> split on E
    B, S, E = 3, 2 * world, 2 * world
    Y = torch.randn(B, S, E, generator=g)
    cs = S // world
    loc = Y[:, rank * cs:(rank + 1) * cs].reshape(B * cs, E)
    out = C.all_to_all(loc, (0, B), (1, 1), world, group)
    ce = E // world
    check("a2a_outer", out, Y.reshape(B * S, E)[:, rank * ce:(rank + 1) * ce])
    # gather of an uneven split (size 4*world - 1), with outer
    n = 4 * world - 1
    Z = torch.randn(2, n, 5, generator=g, requires_grad=True)
    lo, hi = chunk_bounds(n, world, rank)
    zl = Z[:, lo:hi].detach().requires_grad_()
    full = C.gather(zl, (1, 1, n, 1), world, rank, group)
    check("gather_uneven", full, Z.detach())
    V = torch.randn(Z.shape, generator=g)
    (full * V).sum().backward()
    check("gather_bwd", zl.grad, V[:, lo:hi])
    # halo window: x[:, 1:] of a split dim, forward and backward
    T = torch.randn(2, 4 * world, generator=g)
    c = T.shape[1] // world
    tl = T[:, rank * c:(rank + 1) * c].clone().requires_grad_()
    w = C.window(tl, 1, T.shape[1], 1, T.shape[1] - 1, world, rank, group)
    a, b = chunk_bounds(T.shape[1] - 1, world, rank)
    check("window_fwd", w, T[:, 1:][:, a:b])
    G = torch.randn(2, T.shape[1] - 1, generator=g)
    (w * G[:, a:b]).sum().backward()
    want = torch.zeros_like(T)
    want[:, 1:] = G
    check("window_bwd", tl.grad, want[:, rank * c:(rank + 1) * c])
    return errs


def case_dtensor_native(world: int) -> dict:
    """A DTensor-authored model: eager inside ``spdsl.dtensor_attention()`` (spdsl's Ulysses
    handler in DTensor's dispatcher; the process group's collectives counted), eager without it
    (DTensor's own: what ``import spdsl`` leaves in place), and traced."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    from examples.dtensor_native import Block, loss_of

    mesh = spdsl.mesh(sp=world)
    ref = _pair(Block)[0]
    ids = _ids(1, 16 * world, vocab=128)
    labels = torch.roll(ids, -1, dims=1)
    loss_ref = loss_of(ref(ids), labels)
    loss_ref.backward()
    d_ids = distribute_tensor(ids, mesh, [Shard(1)])
    d_labels = distribute_tensor(labels, mesh, [Shard(1)])

    def eager_step():
        eager = distribute_module(copy.deepcopy(ref), mesh)
        eager.zero_grad(set_to_none=True)
        with _pg_calls() as calls:
            logits = eager(d_ids)
            loss = loss_of(logits, d_labels).redistribute(mesh, [Replicate()]).to_local()
            loss.backward()
        for p in eager.parameters():
            p.grad = p.grad.full_tensor()
        return _errs(eager, ref, loss, loss_ref), repr(logits.placements), calls

    out = {}
    with spdsl.dtensor_attention():
        out["eager"], out["placements"], out["eager_calls"] = eager_step()
    try:        # DTensor alone: no strategy for the CPU kernel (raises), or its own (gathers)
        _, _, out["dtensor_own_calls"] = eager_step()
    except NotImplementedError as e:
        out["dtensor_own_calls"] = str(e).splitlines()[0]
    traced = distribute_module(copy.deepcopy(ref), mesh)
    step = spdsl.shard(lambda i, t: loss_of(traced(i), t), mesh=mesh, in_specs=(None, None),
                       out_specs=P())
    loss2 = step(d_ids, d_labels)
    loss2.backward()
    for p in traced.parameters():
        p.grad = p.grad.full_tensor()
    out["traced"] = _errs(traced, ref, loss2, loss_ref)
    return out


class _pg_calls:
    """The process group's collectives inside the block, by kind (profiler ``c10d::`` events)."""

    def __enter__(self) -> collections.Counter:
        self.calls = collections.Counter()
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        return self.calls

    def __exit__(self, *exc) -> None:
        self.prof.__exit__(*exc)
        for e in self.prof.events():
            if e.name.startswith("c10d::"):
                name = e.name.removeprefix("c10d::").rstrip("_")
                self.calls[PG_KINDS.get(name, name)] += 1


def case_user_errors(world: int) -> dict:
    """Errors that need a process group: each message, for the test to read."""
    import torch.distributed as dist

    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = "no error"
        except spdsl.ShardingError as e:
            out[key] = str(e)

    catch("mesh_size", lambda: spdsl.mesh(sp=world + 1))
    mesh = spdsl.mesh(sp=world)
    x = torch.randn(2, 4 * world)
    catch("unknown_axis", lambda: spdsl.shard(lambda t: t.sum(), mesh=mesh,
                                             in_specs=(P(None, "tp"),), out_specs=P())(x))
    model = Llama(LlamaConfig.tiny().replace(n_layers=1))
    ids = _ids(1, 8 * world, seed=dist.get_rank() if world > 1 else 0)
    catch("different_inputs", lambda: spdsl.sp_shard(seq=world, debug=True)(model)(ids, ids))
    return out


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_all(rank: int, world: int, names: list[str] | None = None) -> dict:
    out = {}
    for name, fn in CASES.items():
        if names is None or name in names:
            try:
                out[name] = fn(world)
            except Exception as e:  # noqa: BLE001 - deterministic errors; reported per case
                import traceback
                out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    return out
