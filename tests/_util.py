"""Shared test helpers: one ``assert_close`` that reports max and mean difference; whether
DTensor has a sharding strategy for an op (some are newer than the oldest torch supported)."""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float = 0.0,
                 name: str = "") -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise, reporting the worst."""
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((diff <= bound).all()):
        scale = expected.abs().max().clamp_min(1e-30)
        raise AssertionError(
            f"{name}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
            f"max rel (to max |expected|) {(diff.max() / scale).item():.3e}; "
            f"rtol={rtol}, atol={atol}; {(diff > bound).sum().item()} of {diff.numel()} out"
        )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ``||a - e|| / ||e||`` (robust to near-zero entries)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def dtensor_has_strategy(op) -> bool:
    """Whether DTensor can propagate placements through ``op`` (flip and roll: since torch
    2.13)."""
    from spdsl._torch import dtensor_sharding_propagator
    prop = dtensor_sharding_propagator()
    return any(op in table for table in (
        prop.op_strategy_funcs, prop.op_single_dim_strategy_funcs, prop.op_to_rules))
