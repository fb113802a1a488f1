"""One simulated run: servers, rollout side and trainer on one clock, placed on pools or shared units.

    cfg = sim_config(profile, ["mode=async", "max_staleness=2", "total_steps=20"])
    result = simulate(profile, cfg, Placement.pools(rollout=48, trainer=16))
    result.traj_per_s, result.staleness_hist, result.trainer_idle

Placements:
- `pools(rollout, trainer)`: disjoint units (GPU pools, or CPU cores pinned per side). On GPUs the
  rollout pool holds rollout // engine.units servers; on CPU cores `rollout.num_servers` share it.
- `shared(total)`: both sides on the same units. On CPU cores each side has its base share (half
  in async, all in sync) and borrows the share of a side that waits (utils/cores.py); on GPUs only
  sync is modelled (colocated: every phase gets every GPU, plus `sync.switch_s` per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from async_rl.config import Config, load_config
from async_rl.sim.clock import Clock
from async_rl.sim.profile import Profile, speed_on
from async_rl.sim.rollout import SimRollout
from async_rl.sim.server import SimServer
from async_rl.sim.trainer import SimTrainer, StepRecord
from async_rl.utils.cores import base_share, lent


@dataclass(frozen=True)
class Placement:
    kind: str  # pools | shared
    rollout: int = 0  # pools: units of the rollout side
    trainer: int = 0  # pools: units of the trainer
    total: int = 0  # shared: units of both

    @classmethod
    def pools(cls, rollout: int, trainer: int) -> "Placement":
        return cls("pools", rollout=rollout, trainer=trainer)

    @classmethod
    def shared(cls, total: int) -> "Placement":
        return cls("shared", total=total)

    def label(self) -> str:
        return f"{self.rollout}:{self.trainer}" if self.kind == "pools" else f"shared {self.total}"


@dataclass
class SimResult:
    placement: Placement
    mode: str
    eta: int
    records: list[StepRecord]
    warmup: int
    servers: int
    arrivals: list[int] = field(default_factory=list)
    scale: int = 1  # simulated at 1/scale of the units and the batch (same load per server): counts x scale
    restarted: int = 0
    skipped: int = 0
    events: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.records[-1].end_s

    @property
    def trained(self) -> int:
        return sum(r.kept for r in self.records) * self.scale

    @property
    def traj_per_s(self) -> float:
        """Trained trajectories per second over the whole run (from the first admission)."""
        return self.trained / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.records) * self.scale / self.wall_s

    def _window(self) -> tuple[list[StepRecord], float]:
        w = min(self.warmup, len(self.records) - 2)
        return self.records[w + 1:], self.records[-1].end_s - self.records[w].end_s

    @property
    def steady_traj_per_s(self) -> float:
        rows, span = self._window()
        return sum(r.kept for r in rows) * self.scale / span

    @property
    def trainer_idle(self) -> float:
        rows, span = self._window()
        return sum(r.wait_s for r in rows) / span

    @property
    def engine_idle(self) -> float:
        w = min(self.warmup, len(self.records) - 2)
        busy = self.records[-1].engine_busy_s - self.records[w].engine_busy_s
        span = self.records[-1].end_s - self.records[w].end_s
        return 1.0 - busy / (span * self.servers)

    @property
    def staleness_hist(self) -> list[int]:
        """Every arrival by the lag of its oldest token (batches dropped whole included); last bin > eta."""
        return [n * self.scale for n in self.arrivals]

    @property
    def interrupted_frac(self) -> float:
        return sum(r.interrupted for r in self.records) / max(1, sum(r.kept + r.dropped for r in self.records))


def sim_config(profile: Profile, overrides: list[str] = ()) -> Config:
    """The real Config of a simulated run: the profile's workload keys, then `overrides`."""
    items = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in profile.config.items()]
    return load_config(None, [*items, *overrides])


def scale_down(profile: Profile, cfg: Config, placements: list[Placement], min_batch: int = 512) -> int:
    """The largest power of 2 that divides every placement's pools (in whole servers), the batch (in whole
    groups) and keeps at least `min_batch` trajectories a batch: a GPU run simulated at 1/scale of its
    units and batch has the same load per server and per trainer GPU, at 1/scale of the events."""
    if profile.units != "gpu":
        return 1
    tp, b, n = profile.engine.units, cfg.trainer.batch_size, cfg.rollout.group_size
    k = 1
    while True:
        k2 = 2 * k
        fits = b % (k2 * n) == 0 and b // k2 >= min_batch and all(
            p.total % (k2 * tp) == 0 if p.kind == "shared" else p.rollout % (k2 * tp) == 0 and p.trainer % k2 == 0
            for p in placements)
        if not fits:
            return k
        k = k2


def simulate_scaled(profile: Profile, cfg: Config, placement: Placement, scale: int, seed: int = 0) -> SimResult:
    """`simulate` at 1/scale of the units and the batch (see scale_down); counts come back multiplied."""
    if scale == 1:
        return simulate(profile, cfg, placement, seed)
    small = Placement(placement.kind, placement.rollout // scale, placement.trainer // scale, placement.total // scale)
    cfg = replace(cfg, trainer=replace(cfg.trainer, batch_size=cfg.trainer.batch_size // scale),
                  rollout=replace(cfg.rollout, max_concurrent=max(1, cfg.rollout.max_concurrent // scale)))
    result = simulate(profile, cfg, small, seed)
    result.placement, result.scale = placement, scale
    return result


def simulate(profile: Profile, cfg: Config, placement: Placement, seed: int = 0, warmup: int = 3) -> SimResult:
    clock = Clock()
    e, t = profile.engine, profile.trainer
    colocated = placement.kind == "shared" and profile.units == "gpu"
    if colocated and cfg.mode != "sync":
        raise ValueError("--split shared on GPUs: only sync is modelled (colocated generation and training "
                         "taking turns); async on shared GPUs is the roadmap's colocated mode")
    if profile.units == "gpu":
        rollout_units = placement.total if colocated else placement.rollout
        n_servers = rollout_units // e.units
        if n_servers < 1:
            raise ValueError(f"--split: {rollout_units} rollout GPUs hold no server of {e.units} GPUs (engine.units)")
    else:
        n_servers = cfg.rollout.num_servers
        rollout_units = placement.total if placement.kind == "shared" else placement.rollout
    trainer_units = placement.total if placement.kind == "shared" else placement.trainer
    if trainer_units < 1 or rollout_units < 1:
        raise ValueError(f"--split {placement.label()}: each side needs at least one unit")
    rng = np.random.default_rng(seed)
    state = _Sharing(placement, cfg.mode, profile.units == "core")
    per_server = rollout_units / n_servers

    # CPU cores: a side runs slower while the other works at the same moment (profile.*.overlap_*)
    one_machine = profile.units == "core"
    engine_overlap = getattr(e, f"overlap_{placement.kind}") if one_machine else 1.0
    trainer_overlap = getattr(t, f"overlap_{placement.kind}") if one_machine else 1.0

    def engine_speed() -> float:
        units = state.engine_units(trainer.busy) if state.cores else per_server
        return speed_on(units, e.units, e.scaling) / (engine_overlap if trainer.busy else 1.0)

    def trainer_speed() -> float:
        engine_busy = any(s.busy for s in servers)
        units = state.trainer_units(engine_busy) if state.cores else trainer_units
        return speed_on(units, t.units, t.scaling) / (trainer_overlap if engine_busy else 1.0)

    def engine_busy_changed(_server: SimServer) -> None:
        if state.cores or trainer_overlap != 1.0:
            trainer.replan()

    def trainer_busy_changed() -> None:
        if state.cores or engine_overlap != 1.0:
            for s in servers:
                s.poke()

    servers = [SimServer(i, e, clock, engine_speed, lambda seq: None, engine_busy_changed) for i in range(n_servers)]
    switch = profile.sync.switch_s if colocated else 0.0
    trainer = SimTrainer(cfg, clock, lambda tokens: t.step_s(tokens) + switch, profile.sync.publish_total_s(),
                         trainer_speed, trainer_busy_changed, lambda: sum(s.busy_until_now() for s in servers))
    rollout = SimRollout(cfg, clock, servers, profile.sync, profile.response.sampler(rng), profile.prompt_len,
                         trainer.push)
    trainer.rollout = rollout
    rollout.admit()
    clock.run(until=lambda: trainer.finished)
    if not trainer.finished:
        raise RuntimeError(f"simulation stalled after {len(trainer.records)} of {cfg.total_steps} steps "
                           f"(nothing left to do at t={clock.now:.1f}s)")
    return SimResult(placement, cfg.mode, trainer.eta, trainer.records, warmup, n_servers, trainer.arrivals,
                     restarted=rollout.restarted, skipped=trainer.skipped, events=clock.events_run)


class _Sharing:
    """Cores of one machine shared by the engine and the trainer (launch: cores.share)."""

    def __init__(self, placement: Placement, mode: str, cores: bool):
        self.cores = cores and placement.kind == "shared"
        self.total = placement.total
        self.base = base_share(0, mode, placement.total) if self.cores else 0

    def engine_units(self, trainer_busy: bool) -> int:
        return lent(self.base, self.total, [self.base] if trainer_busy else [])

    def trainer_units(self, engine_busy: bool) -> int:
        return lent(self.base, self.total, [self.base] if engine_busy else [])
