"""Learning-rate schedules: the factor on `trainer.lr` at each train step (policy version).

    factor = get_lr_schedule("linear")(step=10, warmup=0, total=14)   # 1 - 10/14
    factor = get_lr_schedule("cosine")(step=10, warmup=0, total=14, hold=7, floor=0.1)   # held, then decayed to 0.1

A schedule is a pure function of the step the trainer is at (its policy version, so a resumed run is at
the same point of it), the warm-up steps (a linear ramp from 1/(warmup+1) to 1) and the step the decay
ends at (`trainer.lr_decay_steps`; a run fills in its total_steps for 0, and a trainer built without a
run reads 0 as no decay). Decays reach 0 at the end, as the schedulers of transformers and TRL's
GRPOTrainer (linear by default) do; after it, the factor stays there. Two options shape a decay: `hold`
(`trainer.lr_hold_steps`) keeps the full rate that many steps after the warm-up before it begins (the
warmup-stable-decay shape, transformers' `warmup_stable_decay`), and `floor` (`trainer.lr_min_ratio`) is
the factor it ends at instead of 0 (transformers' `cosine_with_min_lr`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

LrSchedule = Callable[..., float]  # (step, warmup, total, hold=0, floor=0.0) -> factor


def _decay(progress: Callable[[float], float]) -> LrSchedule:
    def schedule(step: int, warmup: int, total: int, hold: int = 0, floor: float = 0.0) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if total <= 0:  # no span known: no decay
            return 1.0
        start = warmup + hold
        span = max(1, total - start)
        return floor + (1.0 - floor) * progress(min(1.0, max(0.0, (step - start) / span)))
    return schedule


LR_SCHEDULES: dict[str, LrSchedule] = {
    "constant": _decay(lambda p: 1.0),
    "linear": _decay(lambda p: 1.0 - p),
    "cosine": _decay(lambda p: 0.5 * (1.0 + math.cos(math.pi * p))),
}


def get_lr_schedule(name: str) -> LrSchedule:
    if name not in LR_SCHEDULES:
        raise ValueError(f"trainer.lr_schedule: unknown schedule {name!r} (available: {', '.join(sorted(LR_SCHEDULES))})")
    return LR_SCHEDULES[name]
