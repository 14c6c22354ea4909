"""The ``torch.ops.spdsl`` kernel ops: schema/fake/autograd registration, and one graph node each.

``opcheck`` runs each op for real (under the interpreter here) and against its fake
implementation and autograd registration; the compile test shows dynamo captures a model step
with ``fullgraph=True``, every kernel as a single node, and that compiled gradients match eager.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import spdsl.kernels as K


def _op_samples():
    gen = torch.Generator().manual_seed(0)

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    seg = torch.tensor([[0] * 9 + [1] * 11])
    ang = torch.randn(20, 16, generator=gen)
    target = torch.randint(0, 40, (20,), generator=gen)
    target[::4] = -100
    ops = torch.ops.spdsl
    return [
        pytest.param(ops.flash_attn.default, (r(1, 2, 20, 16), r(1, 1, 20, 16), r(1, 1, 20, 16),
                                              seg, True, 0.25), id="flash_attn"),
        pytest.param(ops.rms_norm.default, (r(3, 20, 16), r(16), 1e-6), id="rms_norm"),
        pytest.param(ops.rope.default, (r(1, 2, 20, 16), ang.cos(), ang.sin()), id="rope"),
        pytest.param(ops.swiglu.default, (r(5, 33), r(5, 33)), id="swiglu"),
        pytest.param(ops.fused_linear_cross_entropy.default,
                     (r(20, 16), r(40, 16), target, -100, 8, True, True), id="fused_linear_ce"),
    ]


@pytest.mark.interpret
@pytest.mark.parametrize("op, args", _op_samples())
def test_opcheck(op, args, interpret_triton):
    # test_aot_dispatch_dynamic is left out: it retraces with symbolic shapes and costs
    # tens of seconds per op under the interpreter; the compile test below covers AOT.
    torch.library.opcheck(op, args, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor"))


def _step(q, k, v, cos, sin, x, w_norm, w_gate, w_up, w_head, target):
    q, k = K.rope(q, cos, sin), K.rope(k, cos, sin)
    attn = K.flash_attn(q, k, v, causal=True)
    h = K.rms_norm(attn.transpose(1, 2).flatten(2) + x, w_norm)
    h = K.swiglu(h @ w_gate, h @ w_up)
    loss_sum, count = K.fused_linear_cross_entropy(h.flatten(0, 1), w_head, target)
    return loss_sum / count


def _step_inputs(device):
    gen = torch.Generator().manual_seed(0)
    b, h, h_kv, s, d, v = 1, 2, 1, 12, 16, 50
    e = h * d
    shapes = [(b, h, s, d), (b, h_kv, s, d), (b, h_kv, s, d)]
    q, k, vv = (torch.randn(*sh, generator=gen) for sh in shapes)
    ang = torch.randn(s, d, generator=gen)
    x = torch.randn(b, s, e, generator=gen)
    weights = [torch.ones(e), torch.randn(e, 24, generator=gen) * 0.2,
               torch.randn(e, 24, generator=gen) * 0.2, torch.randn(v, 24, generator=gen) * 0.2]
    target = torch.randint(0, v, (b * s,), generator=gen)
    return [t.to(device) for t in (q, k, vv, ang.cos(), ang.sin(), x, *weights, target)]


GRAD_IDX = [0, 1, 2, 5, 6, 7, 8, 9]


def _run(fn, args):
    inputs = [a.clone().requires_grad_(i in GRAD_IDX) for i, a in enumerate(args)]
    loss = fn(*inputs)
    return loss, torch.autograd.grad(loss, [inputs[i] for i in GRAD_IDX])


@pytest.mark.interpret
@pytest.mark.compile
def test_compiled_step_is_one_graph_with_one_node_per_kernel(interpret_triton):
    args = _step_inputs(interpret_triton)
    graphs: dict[str, list] = {"dynamo": [], "forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def capture(gm, example_inputs):
        graphs["dynamo"].append(gm)
        return aot(gm, example_inputs)

    eager_loss, eager_grads = _run(_step, args)
    compiled_loss, compiled_grads = _run(torch.compile(_step, backend=capture, fullgraph=True),
                                         args)
    assert [len(g) for g in graphs.values()] == [1, 1, 1]
    expected = {
        "forward": {"flash_attn": 1, "rope": 2, "rms_norm": 1, "swiglu": 1,
                    "fused_linear_cross_entropy": 1},
        "backward": {"flash_attn_backward": 1, "rope_backward": 2, "rms_norm_backward": 1,
                     "swiglu_backward": 1},
    }
    for kind, ops in expected.items():
        targets = [str(n.target) for n in graphs[kind][0].graph.nodes if n.op == "call_function"]
        for name, count in ops.items():
            assert sum(t == f"spdsl.{name}.default" for t in targets) == count, (kind, name)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=0)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.compile
def test_inductor_compiled_step_matches_eager_gpu(cuda_triton):
    """Inductor around the custom ops, fullgraph, on CUDA: same loss and gradients as eager."""
    args = _step_inputs(cuda_triton)
    eager_loss, eager_grads = _run(_step, args)
    compiled_loss, compiled_grads = _run(torch.compile(_step, fullgraph=True), args)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
