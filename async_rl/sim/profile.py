"""A simulator profile: how fast one set-up runs one workload, as plain numbers that say where they came from.

    profile = load_profile("configs/sim/areal_h800_r1distill_1p5b.yaml")
    profile.engine.step_s(seqs=64, ctx=64 * 4000, prefill=0)    # one engine step, seconds
    profile.trainer.step_s(tokens=2_000_000, units=64)           # one train step on 64 devices

Numbers come from `async-rl sim calibrate RUN_DIR` (measured on a run of this project) or, for GPU
set-ups, from a `derive:` section of published hardware and model numbers (`gpu.py`). Every
profile lists its `sources`. `config` holds the run's own settings as dotted keys (batch size, group
size, ...), applied over the config defaults: the simulator runs the real components' rules on a
real `Config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from async_rl.sim.lengths import LengthDist

UNIT_KINDS = ("gpu", "core")


@dataclass
class EngineProfile:
    """One generation server: a step decodes one token for each running sequence and computes up to
    `max_tokens_per_step` prompt / KV-recompute tokens."""

    step_base_s: float = 0.0  # fixed cost of a step (weights read once, launch overheads)
    per_seq_s: float = 0.0  # per sequence sampled in the step
    per_ctx_token_s: float = 0.0  # per token of context those sequences attend to (KV read)
    per_prefill_token_s: float = 0.0  # per prompt or KV-recompute token computed in the step
    # CPU cores only: the rollout side's own work for one request (HTTP, streaming, tokenising, the
    # agent and the reward), seconds of one core (single-threaded Python: not scaled by `speed`),
    # charged to the step of the server that takes the request in, as on a run whose controller shares
    # the servers' cores. One controller feeding many servers is a serial cost this spreads over them:
    # a sweep over more servers than the calibration run understates it. 0 on GPUs (the host's cores
    # do it while the device steps).
    per_request_s: float = 0.0
    units: int = 1  # devices (tensor parallel GPUs) or CPU cores one server runs on at these speeds
    scaling: float = 1.0  # speed on u units instead of `units`: (u / units) ** scaling (CPU cores lent)
    max_running: int = 64  # sequences decoded together (KV capacity at the mean context on a GPU)
    max_tokens_per_step: int = 2048
    # CPU cores only: how much slower a step runs while the trainer works on the same machine at the
    # same time (shared caches and memory bandwidth; threads over the cores when they share them), by
    # placement. 1 = no effect (GPUs: separate devices). Measured by calibrating on an async run.
    overlap_pools: float = 1.0
    overlap_shared: float = 1.0

    def step_s(self, seqs: int, ctx: float, prefill: float, speed: float = 1.0) -> float:
        return self.steps_s(1, seqs, ctx, prefill, speed)

    def steps_s(self, steps: float, seqs: float, ctx: float, prefill: float, speed: float = 1.0) -> float:
        """`steps` steps whose sequences, context and prefill tokens add up to seqs, ctx and prefill."""
        return (self.step_base_s * steps + self.per_seq_s * seqs + self.per_ctx_token_s * ctx
                + self.per_prefill_token_s * prefill) / speed


@dataclass
class TrainerProfile:
    """The trainer: a step costs an overhead plus a time per batch token (prompt + response)."""

    step_overhead_s: float = 0.0
    per_token_s: float = 0.0  # seconds per batch token on `units` devices
    units: int = 1
    scaling: float = 1.0  # speed on u units: (u / units) ** scaling (1 = perfect data parallelism)
    overlap_pools: float = 1.0  # CPU cores only: slowdown while the engine works at the same time (see engine)
    overlap_shared: float = 1.0

    def step_s(self, tokens: float, units: float | None = None) -> float:
        speed = speed_on(units, self.units, self.scaling)
        return (self.step_overhead_s + self.per_token_s * tokens) / speed


@dataclass
class SyncProfile:
    """A weight update: the trainer publishes (busy), then every server pauses, loads and goes on."""

    publish_s: float = 0.0  # trainer side, fixed part (gather, serialise, write)
    bytes: float = 0.0  # weights sent per version
    bandwidth_bytes_s: float = 0.0  # 0: no transfer term
    load_s: float = 0.0  # each server, paused: receive and load a version
    recompute: bool = True  # in-flight sequences recompute their KV with the new weights (else kept)
    switch_s: float = 0.0  # colocated GPUs only: release generation memory and take it back, per step

    def publish_total_s(self) -> float:
        transfer = self.bytes / self.bandwidth_bytes_s if self.bandwidth_bytes_s > 0 else 0.0
        return self.publish_s + transfer


@dataclass
class Profile:
    name: str = "profile"
    units: str = "gpu"  # what `units` count: gpu | core
    sources: list[str] = field(default_factory=list)
    engine: EngineProfile = field(default_factory=EngineProfile)
    trainer: TrainerProfile = field(default_factory=TrainerProfile)
    sync: SyncProfile = field(default_factory=SyncProfile)
    response: LengthDist = field(default_factory=LengthDist)
    prompt_len: int = 1
    config: dict[str, Any] = field(default_factory=dict)  # dotted config keys of the workload
    measured: dict[str, Any] = field(default_factory=dict)  # calibration: what the run itself measured
    derive: dict[str, Any] = field(default_factory=dict)  # GPU profiles: the published numbers used (gpu.py)

    def validate(self) -> None:
        if self.units not in UNIT_KINDS:
            raise ValueError(f"units: must be one of {', '.join(UNIT_KINDS)}, got {self.units!r}")
        for key in ("step_base_s", "per_seq_s", "per_ctx_token_s", "per_prefill_token_s", "per_request_s"):
            if getattr(self.engine, key) < 0:
                raise ValueError(f"engine.{key}: must be >= 0, got {getattr(self.engine, key)}")
        if self.engine.step_s(1, 1, 0) <= 0:
            raise ValueError("engine: a step takes no time (set step_base_s or per_seq_s > 0)")
        if self.trainer.step_s(1) <= 0 or self.trainer.per_token_s < 0 or self.trainer.step_overhead_s < 0:
            raise ValueError("trainer: step_overhead_s and per_token_s must be >= 0, not both 0")
        for part in ("engine", "trainer"):
            for key in ("overlap_pools", "overlap_shared"):
                if getattr(getattr(self, part), key) < 1:
                    raise ValueError(f"{part}.{key}: a slowdown, must be >= 1, got {getattr(getattr(self, part), key)}")
        for key in ("units", "max_running", "max_tokens_per_step"):
            if getattr(self.engine, key) < 1:
                raise ValueError(f"engine.{key}: must be >= 1, got {getattr(self.engine, key)}")
        if self.trainer.units < 1:
            raise ValueError(f"trainer.units: must be >= 1, got {self.trainer.units}")
        for key in ("publish_s", "bytes", "bandwidth_bytes_s", "load_s", "switch_s"):
            if getattr(self.sync, key) < 0:
                raise ValueError(f"sync.{key}: must be >= 0, got {getattr(self.sync, key)}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len: must be >= 1, got {self.prompt_len}")
        self.response.validate()


def speed_on(units: float | None, base: int, scaling: float) -> float:
    """Relative speed on `units` of what a profile measured on `base` (None: on `base`)."""
    if units is None or units == base:
        return 1.0
    return (units / base) ** scaling


_PARTS = {"engine": EngineProfile, "trainer": TrainerProfile, "sync": SyncProfile, "response": LengthDist}


def profile_from_dict(data: dict[str, Any], where: str = "profile") -> Profile:
    """A validated Profile from a YAML mapping; unknown keys and bad values are one error naming the key."""
    from async_rl.sim.gpu import derive

    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of profile keys")
    data = dict(data)
    if data.get("derive"):
        data = derive(data)
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown profile key (known: {', '.join(sorted(known))})")
    kwargs = {}
    for key, value in data.items():
        if key in _PARTS:
            if not isinstance(value, dict):
                raise ValueError(f"{key}: expected a mapping")
            fields = {f.name for f in dataclasses.fields(_PARTS[key])}
            bad = sorted(set(value) - fields)
            if bad:
                raise ValueError(f"{key}.{bad[0]}: unknown key (known: {', '.join(sorted(fields))})")
            value = _PARTS[key](**value)
        kwargs[key] = value
    profile = Profile(**kwargs)
    _check_numbers(profile)
    profile.validate()
    return profile


def _check_numbers(profile: Profile) -> None:
    for part in ("engine", "trainer", "sync"):
        for f in dataclasses.fields(getattr(profile, part)):
            value = getattr(getattr(profile, part), f.name)
            if f.type in ("float", "int") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                               or not math.isfinite(value)):
                raise ValueError(f"{part}.{f.name}: expected a number, got {value!r}")


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--profile: no such file: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return profile_from_dict(data, str(p))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    out = dataclasses.asdict(profile)
    if not out["derive"]:
        del out["derive"]
    if not out["measured"]:
        del out["measured"]
    return out


def save_profile(profile: Profile, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(profile_to_dict(profile), sort_keys=False, default_flow_style=None, width=120))
    return p
