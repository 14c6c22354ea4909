"""The run configuration a program is checked under, drawn from its seed like the program.

A configuration is the mesh (``sp`` alone, or ``dp x sp`` at 4 ranks), ``shard_state``
(the program's weights become parameters of a module, split over every rank), the remat mode
and ``compile``. It is printed into a failure's source as a ``RUN = {...}`` line, which
``--repro`` reads back, so a repro runs the way the failure did::

    cfg = draw(seed=7, world=4)        # RunConfig(dp=2, sp=2, remat='auto', ...)
    source = with_config(render(generate(7)), cfg)
    assert config_of(source) == cfg

``compile=True`` is drawn for one seed in ``COMPILE_PERIOD`` (a cold compile costs 20-80 s on
a CPU, more than a hundred eager programs), at SP 2 only: the CI set holds exactly one.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import asdict, dataclass

REMATS = ("none", "auto", "full")
COMPILE_PERIOD = 400


@dataclass(frozen=True)
class RunConfig:
    dp: int = 1
    sp: int = 2
    remat: str = "none"
    shard_state: bool = False
    compile: bool = False

    def __str__(self) -> str:
        mesh = f"dp {self.dp} x sp {self.sp}" if self.dp > 1 else f"sp {self.sp}"
        flags = [f"remat={self.remat}"] + [k for k in ("shard_state", "compile")
                                            if getattr(self, k)]
        return f"{mesh}, {', '.join(flags)}"


def draw(seed: int, world: int) -> RunConfig:
    """The configuration of program ``seed`` on ``world`` ranks (deterministic in both)."""
    r = random.Random(f"config:{seed}:{world}")
    dp = 2 if world == 4 and r.random() < 0.5 else 1
    return RunConfig(dp=dp, sp=world // dp, remat=r.choice(REMATS),
                     shard_state=r.random() < 0.4,
                     compile=world == 2 and seed % COMPILE_PERIOD == 0)


def with_config(source: str, cfg: RunConfig) -> str:
    return f"{without_config(source).rstrip()}\n\nRUN = {asdict(cfg)!r}\n"


def without_config(source: str) -> str:
    return re.sub(r"(?m)^RUN = \{.*\}\n?", "", source)


def config_of(source: str, world: int) -> RunConfig:
    """The ``RUN`` line of ``source``; a program without one runs on ``sp`` alone, eagerly.
    A line naming no mesh (``RUN = {'remat': 'full'}``) runs on ``sp`` over ``world``."""
    m = re.search(r"(?m)^RUN = (\{.*\})$", source)
    return RunConfig(**{"sp": world, **ast.literal_eval(m.group(1))}) if m else \
        RunConfig(sp=world)
