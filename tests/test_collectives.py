"""``spdsl.collectives`` is one module to the rest of spdsl (``import spdsl.collectives as C``):
its public functions report it as their module wherever in the package they are defined, and
that is how the lowering tells a collective's node from an op (a gradient marker is not moved
across one onto a parameter, ``spdsl.lower.grad_buckets.move_markers_to_inputs``)."""

from __future__ import annotations

import inspect

import torch

import spdsl.collectives as C
from spdsl.lower.grad_buckets import move_markers_to_inputs


def test_public_names_report_the_package():
    named = [n for n in C.__all__ if inspect.isfunction(getattr(C, n))]
    assert {"all_to_all", "gather", "grad_all_reduce", "backward_order", "barrier"} <= set(named)
    assert [n for n in named if getattr(C, n).__module__ != "spdsl.collectives"] == []


def _marked(op) -> torch.fx.Graph:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(op, (x, (0, 1, 8, 1), 2, 0, "sp"))
    g.output(g.call_function(C.grad_all_reduce, (y, "sp")))
    return g


def test_a_marker_stays_after_a_collective_and_moves_past_an_op():
    g = _marked(C.gather)
    move_markers_to_inputs(g)
    (marker,) = [n for n in g.nodes if n.target is C.grad_all_reduce]
    assert marker.args[0].target is C.gather

    def op(x, *args):
        return x
    g = _marked(op)
    move_markers_to_inputs(g)
    (marker,) = [n for n in g.nodes if n.target is C.grad_all_reduce]
    assert marker.args[0].op == "placeholder"
