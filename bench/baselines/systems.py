"""What a benchmarked system is, and the list of them.

A system builds a ``Trainer`` for one run. Every trainer receives the same *global* batch on
every rank and must leave, after ``forward_backward``, the exact single-device gradient in
``p.grad`` of the model's parameters on every rank, and return the exact global loss. How it
shards (by hand, by AutoSP, by spdsl) is its own business; so are its collectives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class Unavailable(Exception):
    """The system cannot run here (not installed, not written yet); the reason is reported."""


@dataclass(frozen=True)
class RunConfig:
    model: str          # a key of model.CONFIGS
    batch: int
    world: int          # SP degree = number of ranks
    rank: int
    seed: int
    lr: float
    hf_family: str = "llama"   # the HF comparison's model: "llama" or "mixtral" (hf_model.py)


class Trainer(Protocol):
    llama: torch.nn.Module   # the parameters whose .grad is compared with the reference

    def zero_grad(self) -> None: ...

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One forward and backward on the global batch; the global loss, on every rank."""

    def optimizer_step(self) -> None: ...


@dataclass(frozen=True)
class System:
    name: str
    mode: str                          # "eager" or "compiled"
    module: str                        # bench.baselines.<module> holding build(cfg, compiled)
    single_process: bool = False       # the reference: rank 0 alone, the others wait
    builder: str = "build"             # the function of ``module`` that builds the trainer

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    @property
    def compiled(self) -> bool:
        return self.mode == "compiled"

    def build(self, cfg: RunConfig) -> Trainer:
        # Imported lazily: deepspeed and spdsl are optional, and importing either is slow.
        mod = importlib.import_module(f"bench.baselines.{self.module}")
        build: Callable[[RunConfig, bool], Trainer] = getattr(mod, self.builder)
        return build(cfg, self.compiled)


# The order they run in: AutoSP last, because deepspeed.initialize patches global state.
SYSTEMS = [
    System("reference", "eager", "reference", single_process=True),
    System("ulysses", "eager", "ulysses"),
    System("ulysses", "compiled", "ulysses"),
    System("ring", "eager", "ring"),
    System("ring", "compiled", "ring"),
    System("ring-zigzag", "eager", "ring", builder="build_zigzag"),
    System("ring-zigzag", "compiled", "ring", builder="build_zigzag"),
    System("spdsl", "eager", "spdsl_adapter"),
    System("spdsl", "compiled", "spdsl_adapter"),
    System("spdsl-ring", "eager", "spdsl_adapter", builder="build_ring"),
    System("spdsl-ring", "compiled", "spdsl_adapter", builder="build_ring"),
    System("autosp", "compiled", "autosp"),
]

# The Hugging Face comparison (``bench/hf_compare.py``): one tiny random HF LlamaForCausalLM.
HF_SYSTEMS = [
    System("reference", "eager", "hf_model", single_process=True, builder="build_reference"),
    System("spdsl", "eager", "hf_model", builder="build_spdsl"),
    System("alst", "eager", "alst_hf"),
    # matched settings: spdsl keeping only layer inputs against ALST with HF's own gradient
    # checkpointing (both recompute each layer's forward in backward, all-to-alls included)
    System("spdsl-full", "eager", "hf_model", builder="build_spdsl_full"),
    System("alst-checkpoint", "eager", "alst_hf", builder="build_checkpoint"),
    System("spdsl", "compiled", "hf_model", builder="build_spdsl"),
    System("spdsl-full", "compiled", "hf_model", builder="build_spdsl_full"),
]

# The HF comparison's baseline per system (ALST has no compiled run): the same memory policy.
HF_BASELINE = {"spdsl-full": ("alst-checkpoint", "eager")}

# The hand-written baseline each system's time is divided by (same mode; AutoSP is compiled).
BASELINE = {"eager": ("ulysses", "eager"), "compiled": ("ulysses", "compiled")}

# The analytic floor (``analytic.py``) each system's bytes are read against; others: Ulysses.
FLOOR = {"ring": "ring", "ring-zigzag": "ring", "spdsl-ring": "ring"}


def select(names: list[str] | None, systems: list[System] = SYSTEMS) -> list[System]:
    """Systems by name (``ulysses``) or label (``ulysses-compiled``); all when ``names`` is None.

    The reference always runs: parity is measured against it.
    """
    if not names:
        return list(systems)
    wanted = set(names) | {"reference"}
    picked = [s for s in systems if s.name in wanted or f"{s.name}-{s.mode}" in wanted]
    known = {s.name for s in systems} | {f"{s.name}-{s.mode}" for s in systems}
    if wanted - known:
        raise SystemExit(f"unknown systems {sorted(wanted - known)}; choose from {sorted(known)}")
    return picked
