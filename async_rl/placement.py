"""Placement: which GPUs each trainer rank and each generation server uses (the GPU pools).

    plan = place(cfg, visible=torch.cuda.device_count(), mask=os.environ.get("CUDA_VISIBLE_DEVICES"))
    plan.trainer.env()                      # {"CUDA_VISIBLE_DEVICES": "0,1"}: the trainer's process (rank r: cuda:r)
    plan.servers[1].env()                   # {"CUDA_VISIBLE_DEVICES": "3"}: server 1's process (cuda:0 inside)
    for_process(cfg, "rollout", plan.servers[1])     # the config that server runs with

One pure function of the config, the number of CUDA devices the placing process sees and
the CUDA_VISIBLE_DEVICES it inherited, so every rule is tested with faked counts and masks
(`gpus_here()` reads the real ones). Under Ray, `ray_gpus` sizes the bundles and `ray_slot`
turns the GPU ids Ray assigned a bundle into the same kind of slot. The rules:

- The pools are disjoint. Auto (empty `cluster.*_gpus`): the trainer takes the first
  `trainer.world_size` free GPUs, the servers the next `rollout.num_servers`; the rest idle.
- A process is handed its GPUs by physical id (the inherited mask's entries, never their
  indices) in CUDA_VISIBLE_DEVICES, and sees them as cuda:0.. (trainer rank r: cuda:r).
- A generation server holds `engine.tp_size` GPUs (its tensor-parallel ranks; SGLang and vLLM
  servers), each one for the embedded engine; `cluster.rollout_gpus` then lists them server by server.
- One GPU for one trainer rank and one server (a single visible GPU, or both lists naming
  the same one) is shared: the engine takes `engine.gpu_memory_fraction` of its memory
  (auto 0.4), the trainer the rest, and `weight_sync.transport=dist` is refused (NCCL
  refuses two ranks on one GPU: "Duplicate GPU detected", NVIDIA/nccl#418).
- What cannot be placed is one ConfigError naming the key, before any process starts.
- CPU sides are unaffected; on a machine with GPUs their processes get CUDA_VISIBLE_DEVICES="".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from async_rl.config import Config, ConfigError

TRAINER, ROLLOUT = "trainer", "rollout"
SIDES = (TRAINER, ROLLOUT)
SHARED_ENGINE_FRACTION = 0.4  # the engine's share of a GPU it shares with the trainer (auto)
ALONE_ENGINE_FRACTION = 0.85  # the embedded engine's share of a GPU of its own (auto; SGLang chooses its own)
KV_RESERVE = 0.1  # of the engine's share, kept out of the KV pool for a step's activations


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSlot:
    """The GPUs of one process: what it is started with and the device it then uses."""

    visible: str | None = None  # its CUDA_VISIBLE_DEVICES (physical ids, "" = none); None = inherited
    device: str = "cpu"  # as the process sees it: cpu | cuda:0 | cuda (a trainer pool: rank r on cuda:r)
    memory_fraction: float = 0.0  # share of its GPU's memory it may take; 0 = all (SGLang: its own choice)

    def env(self) -> dict[str, str]:
        return {} if self.visible is None else {"CUDA_VISIBLE_DEVICES": self.visible}

    def to_wire(self) -> dict:
        return {"visible": self.visible, "device": self.device, "memory_fraction": self.memory_fraction}

    @classmethod
    def from_wire(cls, d: dict) -> GpuSlot:
        return cls(visible=d["visible"], device=d["device"], memory_fraction=float(d["memory_fraction"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    trainer: GpuSlot  # the trainer's process; under launcher=local its ranks are its children, rank r on cuda:r
    servers: tuple[GpuSlot, ...]  # one per generation server started here
    cpu: GpuSlot = GpuSlot()  # a process that uses no GPU (the rollout controller): it sees none
    shared: bool = False  # trainer and engine share one GPU, split by engine.gpu_memory_fraction
    lines: tuple[str, ...] = ()  # what was decided, for the user


_COUNT_KEYS = {TRAINER: ("trainer.world_size", "rank"), ROLLOUT: ("rollout.num_servers", "server")}


def _listed(cfg: Config, side: str) -> list[int]:
    return list(cfg.cluster.trainer_gpus if side == TRAINER else cfg.cluster.rollout_gpus)


def _counts(cfg: Config, sides: tuple[str, ...]) -> dict[str, int]:
    """GPUs each side needs: one per trainer rank, `engine.tp_size` per generation server started here."""
    servers = 0 if cfg.rollout.server_addrs else cfg.rollout.num_servers
    return {TRAINER: cfg.trainer.world_size if TRAINER in sides else 0,
            ROLLOUT: servers * server_gpus(cfg) if ROLLOUT in sides else 0}


def server_gpus(cfg: Config) -> int:
    """GPUs of one generation server: its tensor-parallel ranks."""
    return max(1, cfg.engine.tp_size)


def _device(cfg: Config, side: str) -> tuple[str, str]:
    """(dotted key, spec) of a side's device."""
    if side == TRAINER:
        return "trainer.device", cfg.trainer.device.strip().lower()
    return "engine.device", cfg.engine.device.strip().lower()


def _pinned(key: str, spec: str) -> int | None:
    """N of `cuda:N`, None for the other specs (an unknown one is an error naming the key)."""
    if spec in ("auto", "cpu", "cuda"):
        return None
    match = re.fullmatch(r"cuda:(\d+)", spec)
    if not match:
        raise ConfigError(f"{key}: {spec!r} is not a device (auto | cpu | cuda | cuda:N)")
    return int(match.group(1))


def _on_cuda(cfg: Config, side: str, auto: bool) -> bool:
    """Whether a side runs on CUDA: its device says so (SGLang always does); `auto` follows `auto`."""
    key, spec = _device(cfg, side)
    _pinned(key, spec)
    if side == ROLLOUT and cfg.engine.backend == "sglang":
        if spec == "cpu":
            raise ConfigError("engine.device: engine.backend=sglang runs on CUDA GPUs, not cpu")
        return True
    return auto if spec == "auto" else spec != "cpu"


def _wants_cuda(cfg: Config, side: str, visible: int, mask: str | None) -> bool:
    if not _on_cuda(cfg, side, auto=visible > 0):
        return False
    if visible:
        return True
    none = "none is visible here" + (f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else "")
    if side == ROLLOUT and cfg.engine.backend == "sglang":
        raise ConfigError(f"engine.backend: sglang needs a CUDA GPU for each server, but {none}; "
                          "use engine.backend=embedded, or start SGLang elsewhere (rollout.server_addrs)")
    key, spec = _device(cfg, side)
    raise ConfigError(f"{key}: {spec!r} needs a CUDA device, but {none}; use cpu or auto")


def engine_share(cfg: Config, shared: bool) -> float:
    """The engine's share of its GPU: as configured, else auto (0 = SGLang's own choice)."""
    if cfg.engine.gpu_memory_fraction:
        return cfg.engine.gpu_memory_fraction
    return SHARED_ENGINE_FRACTION if shared else ALONE_ENGINE_FRACTION if cfg.engine.backend == "embedded" else 0.0


def _physical_ids(visible: int, mask: str | None) -> list[str]:
    """The physical id of each visible device: the mask's entries, else 0..visible-1."""
    if mask is None:
        return [str(i) for i in range(visible)]
    entries = [e.strip() for e in mask.split(",") if e.strip()]
    if len(entries) != visible:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES: {mask!r} names {len(entries)} GPU(s), but CUDA finds {visible} "
                          "of them here; name only GPUs this machine has")
    return entries


def _check_lists(cfg: Config, counts: dict[str, int], cuda: dict[str, bool]) -> None:
    """A list for a side that runs nothing on a GPU here is a mistake worth one line."""
    for side in SIDES:
        key = f"cluster.{side}_gpus"
        if not _listed(cfg, side) or cuda[side]:
            continue
        if side == ROLLOUT and cfg.rollout.server_addrs:
            raise ConfigError(f"{key}: rollout.server_addrs is set, so no generation server starts here")
        if counts[side]:
            dev_key, spec = _device(cfg, side)
            why = f"{dev_key}={spec}" if spec == "cpu" else "no CUDA device is visible here"
            raise ConfigError(f"{key}: lists GPUs, but the {side} side runs on cpu ({why})")


def _explicit(cfg: Config, side: str, n: int, ids: list[str]) -> list[int]:
    """The GPUs a side's list (or `cuda:N` device) names, checked; [] = auto."""
    key, (count_key, unit), listed = f"cluster.{side}_gpus", _COUNT_KEYS[side], _listed(cfg, side)
    dev_key, spec = _device(cfg, side)
    pin = _pinned(dev_key, spec)
    if pin is not None:
        if listed:
            raise ConfigError(f"{dev_key}: {spec!r} and {key} both choose GPUs; keep one ({key} for pools)")
        if n > 1:
            raise ConfigError(f"{dev_key}: {spec!r} pins one GPU, but {count_key}={n} needs one per {unit}; "
                              f"use cuda or auto, and {key} to choose them")
        listed, key = [pin], dev_key
    for i in listed:
        if not 0 <= i < len(ids):
            seen = f"CUDA_VISIBLE_DEVICES={','.join(ids)}" if ids else "none"
            raise ConfigError(f"{key}: names GPU {i}, but this process sees {len(ids)} (cuda:0..{len(ids) - 1}; "
                              f"indices count within {seen})")
    if len(set(listed)) != len(listed):
        raise ConfigError(f"{key}: names a GPU twice ({listed}); one process per GPU")
    if listed and len(listed) != n:
        tp = server_gpus(cfg) if side == ROLLOUT else 1
        per = f"engine.tp_size={tp} per {unit}" if tp > 1 else f"one per {unit}"
        raise ConfigError(f"{key}: lists {len(listed)} GPU(s) for {count_key}={n // tp} ({per})")
    return listed


def _too_few(side: str, n: int, free: int, visible: int, trainer: int, tp: int = 1) -> ConfigError:
    if side == TRAINER:
        return ConfigError(f"trainer.world_size: {n} ranks need {n} GPUs (one each), but {free} of the {visible} "
                           "visible are free for the trainer")
    beside = f" beside the trainer's {trainer} (trainer.world_size)" if trainer else ""
    each = f" ({tp} each: engine.tp_size)" if tp > 1 else ""
    return ConfigError(f"rollout.num_servers: {n // tp} servers need {n} GPUs of their own{each}{beside}, but {free} "
                       f"of the {visible} visible are left; lower rollout.num_servers or trainer.world_size, or give "
                       "cluster.trainer_gpus / cluster.rollout_gpus")


def _pools(cfg: Config, counts: dict[str, int], cuda: dict[str, bool], ids: list[str]) -> dict[str, list[int]]:
    """Logical GPU indices of each side: explicit lists first, then trainer-first over what is free."""
    explicit = {side: _explicit(cfg, side, counts[side], ids) if cuda[side] else [] for side in SIDES}
    share_ok = counts[TRAINER] == 1 and counts[ROLLOUT] == 1 and all(cuda.values())  # one GPU each (tp 1)
    both = set(explicit[TRAINER]) & set(explicit[ROLLOUT])
    if both and not (share_ok and explicit[TRAINER] == explicit[ROLLOUT]):
        raise ConfigError(f"cluster.rollout_gpus: GPU(s) {sorted(both)} are also in cluster.trainer_gpus; the pools "
                          "must not overlap (only one trainer rank and one server may share one GPU)")
    free = [i for i in range(len(ids)) if i not in set(explicit[TRAINER]) | set(explicit[ROLLOUT])]
    pools: dict[str, list[int]] = {}
    for side in SIDES:  # the trainer first
        n = counts[side] if cuda[side] else 0
        if explicit[side] or not n:
            pools[side] = explicit[side]
        elif len(free) >= n:
            pools[side], free = free[:n], free[n:]
        elif share_ok and len(ids) == 1:  # one GPU for one rank and one server: they share it
            pools[side] = [0]
        else:
            raise _too_few(side, n, len(free), len(ids), len(pools.get(TRAINER, [])),
                           server_gpus(cfg) if side == ROLLOUT else 1)
    return pools


def place(cfg: Config, *, visible: int, mask: str | None = None, sides: tuple[str, ...] = SIDES) -> Placement:
    """Where the trainer (its ranks) and the generation servers of `sides` run on this machine.

    `visible`: CUDA devices this process sees; `mask`: the CUDA_VISIBLE_DEVICES it inherited
    (None = unset). Raises ConfigError naming the key for anything that cannot be placed."""
    counts = _counts(cfg, sides)
    cuda = {side: counts[side] > 0 and _wants_cuda(cfg, side, visible, mask) for side in SIDES}
    _check_lists(cfg, counts, cuda)
    cpu = GpuSlot(visible="" if visible else None, device="cpu")
    if not any(cuda.values()):
        return Placement(trainer=cpu, servers=(cpu,) * (counts[ROLLOUT] // server_gpus(cfg)), cpu=cpu)
    ids = _physical_ids(visible, mask)
    pools = _pools(cfg, counts, cuda, ids)
    shared = bool(pools[TRAINER]) and pools[TRAINER] == pools[ROLLOUT]
    if shared and cfg.weight_sync.transport == "dist":
        raise ConfigError(f"weight_sync.transport: dist needs the trainer and the generation server on different GPUs "
                          f"(NCCL refuses two ranks on one GPU, NVIDIA/nccl#418), but they share GPU "
                          f"{ids[pools[TRAINER][0]]}; use weight_sync.transport=disk or zmq")
    share = engine_share(cfg, shared)
    trainer = cpu
    if pools[TRAINER]:
        trainer = GpuSlot(visible=",".join(ids[i] for i in pools[TRAINER]),
                          device="cuda" if len(pools[TRAINER]) > 1 else "cuda:0",
                          memory_fraction=round(1.0 - share, 6) if shared else 0.0)
    tp = server_gpus(cfg)  # each server's GPUs: consecutive in the pool (its TP ranks see cuda:0..tp-1)
    gpus = pools[ROLLOUT]
    servers = tuple(GpuSlot(visible=",".join(ids[i] for i in gpus[k:k + tp]), device="cuda:0", memory_fraction=share)
                    for k in range(0, len(gpus), tp)) or (cpu,) * (counts[ROLLOUT] // tp)
    return Placement(trainer=trainer, servers=servers, cpu=cpu, shared=shared,
                     lines=_describe(pools, ids, mask, shared, share))


def _describe(pools: dict[str, list[int]], ids: list[str], mask: str | None, shared: bool,
              engine_share: float) -> tuple[str, ...]:
    name = {TRAINER: "trainer", ROLLOUT: "generation servers"}
    where = " (physical ids)" if mask is not None else ""
    if shared:
        return (f"GPU pools: trainer and generation server share GPU {ids[pools[TRAINER][0]]}{where}: the engine "
                f"takes {engine_share:.0%} of its memory (engine.gpu_memory_fraction), the trainer the rest",)
    parts = [f"{name[s]} on GPU {','.join(ids[i] for i in pools[s])}" for s in SIDES if pools[s]]
    used = set(pools[TRAINER]) | set(pools[ROLLOUT])
    idle = [ids[i] for i in range(len(ids)) if i not in used]
    return (f"GPU pools{where}: " + "; ".join(parts) + (f"; idle: {','.join(idle)}" if idle else ""),)


def ray_gpus(cfg: Config, cluster_gpus: float) -> dict[str, float]:
    """GPUs of one bundle per role under launcher=ray ({"server": g, "trainer": g}): whole GPUs where that side
    runs on CUDA (`auto`: where the cluster has GPUs; a server takes engine.tp_size), none where it runs on cpu."""
    out = {}
    for side, role in ((TRAINER, "trainer"), (ROLLOUT, "server")):
        key, ray_key = f"cluster.{side}_gpus", f"ray.num_gpus_per_{role}"
        if _listed(cfg, side):
            raise ConfigError(f"{key}: launcher=ray gives each process the GPU Ray assigns its bundle; leave it "
                              f"empty (bundle sizes: {ray_key})")
        dev_key, spec = _device(cfg, side)
        if _pinned(dev_key, spec) is not None:
            raise ConfigError(f"{dev_key}: {spec!r} names a GPU, but under launcher=ray each process gets the one "
                              "Ray assigns its bundle; use cuda or auto")
        asked = getattr(cfg.ray, f"num_gpus_per_{role}")
        cuda = _on_cuda(cfg, side, auto=cluster_gpus > 0 or asked > 0)
        whole = server_gpus(cfg) if side == ROLLOUT else 1
        if cuda and asked not in (0, whole):
            what = (f"engine.tp_size={whole} GPUs" if whole > 1
                    else "one whole GPU (one process per GPU: NCCL, the memory split)")
            raise ConfigError(f"{ray_key}: a {role} on CUDA takes {what}; set {whole} or 0 (= {whole} on CUDA), "
                              f"got {asked:g}")
        if not cuda and asked > 0:
            raise ConfigError(f"{ray_key}: {dev_key}={spec}, so a {role} would hold a GPU it never uses; set 0")
        out[role] = float(whole) if cuda else 0.0
    return out


def ray_slot(cfg: Config, side: str | None, gpu_ids: list) -> GpuSlot:
    """The slot of a process in a Ray bundle that was assigned `gpu_ids` (`ray.get_gpu_ids()`, physical ids).
    A bundle without GPUs gets CUDA_VISIBLE_DEVICES="": Ray 2.60 no longer hides the GPUs from it."""
    if not gpu_ids:
        return GpuSlot(visible="", device="cpu")
    return GpuSlot(visible=",".join(str(i) for i in gpu_ids), device="cuda:0",
                   memory_fraction=engine_share(cfg, shared=False) if side == ROLLOUT else 0.0)


def for_process(cfg: Config, side: str, slot: GpuSlot) -> Config:
    """The config a process of `side` runs with in its slot (its device as it sees it; the engine's share)."""
    if side == TRAINER:
        return replace(cfg, trainer=replace(cfg.trainer, device=slot.device))
    return replace(cfg, engine=replace(cfg.engine, device=slot.device, gpu_memory_fraction=slot.memory_fraction))


def kv_cache_bytes(*, fraction: float, total: int, free: int, held: int, bucket: int) -> int:
    """The embedded engine's KV pool on a GPU: its share (`fraction` of `total`) less what it holds (the
    weights), a reserve (KV_RESERVE of the share, for a step's activations) and one weight bucket, and
    never more than is `free` now."""
    share = int(fraction * total)
    budget = min(share - held, free) - int(KV_RESERVE * share) - bucket
    if budget <= 0:
        gib = 2**30
        raise ConfigError(f"engine.gpu_memory_fraction: {fraction:g} of {total / gib:.1f} GiB leaves no KV cache "
                          f"beside the {held / gib:.2f} GiB the engine holds ({free / gib:.1f} GiB free); raise it")
    return budget


def rank_device(device: str, local_rank: int) -> str:
    """The device of trainer rank `local_rank` in a process whose trainer device is `device`:
    a pool (`cuda`) gives rank r its r-th GPU; anything else is that device."""
    return f"cuda:{local_rank}" if device.strip().lower() == "cuda" else device


def gpus_here() -> tuple[int, str | None]:
    """(CUDA devices this process sees, the CUDA_VISIBLE_DEVICES it inherited): what `place` is given."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible, os.environ.get("CUDA_VISIBLE_DEVICES")
