"""What the Ray launcher places: the bundles of a run, and the actor that runs one process in a bundle.

    slots = plan(cfg, cluster_gpus)   # [Slot(name="server", role="server", bundle={"CPU": 1.0, "GPU": 1.0}), ...]
    host = ray.remote(ProcessHost).options(...).remote("trainer", cfg.run_dir)
    host.start.remote("async_rl.launch.trainer_proc:trainer_main", to_yaml(cfg), {}, "trainer")

A side that runs on CUDA gets one whole GPU per bundle (async_rl.placement.ray_gpus), and the
process in it the GPU Ray assigned (`ray_slot`: CUDA_VISIBLE_DEVICES its physical id, device
cuda:0); a process in a bundle without GPUs gets CUDA_VISIBLE_DEVICES="", since Ray 2.60 no
longer hides the node's GPUs from it. `ProcessHost` starts its process with
`async_rl.launch.procs.spawn` on its own node, so logs, the one-line `<name>.error` files and the
orderly SIGTERM stop are those of `launcher=local`;
if the actor itself is killed, the child notices its parent is gone and stops. Configs
travel as YAML text, entry points as `module:function` names. Nothing here imports Ray:
it is an optional extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.config import ConfigError, config_from_yaml_text
from async_rl.placement import ROLLOUT, for_process, ray_gpus, ray_slot

from async_rl.launch.common import free_port
from async_rl.launch.procs import child_error, server_name, spawn, stop_all

# The rollout controller only does I/O: a memory bundle keeps it off the CPUs the engines
# and the trainer use, so the default bundles fit a 2-core machine.
CONTROLLER_BUNDLE = {"memory": 512.0 * 2**20}


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    name: str  # the process's name: its log is run_dir/logs/<name>.log
    role: str  # server | trainer | rollout
    bundle: dict[str, float] = field(default_factory=dict)  # Ray resources of its bundle


def _bundle(cfg: Any, role: str, gpus: float) -> dict[str, float]:
    cpus, asked = getattr(cfg.ray, f"num_cpus_per_{role}"), getattr(cfg.ray, f"num_gpus_per_{role}")
    for key, value in ((f"ray.num_cpus_per_{role}", cpus), (f"ray.num_gpus_per_{role}", asked)):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if cpus == 0 and gpus == 0:
        raise ConfigError(f"ray.num_cpus_per_{role}: a {role} bundle needs CPUs or GPUs, "
                          f"but ray.num_cpus_per_{role} and ray.num_gpus_per_{role} are both 0")
    return {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def plan(cfg: Any, cluster_gpus: float) -> list[Slot]:
    """The run's bundles: servers (unless rollout.server_addrs are given), trainer ranks, the rollout controller.
    `cluster_gpus`: the GPUs of the cluster, which decide where `auto` devices run (whole GPUs per bundle)."""
    servers = 0 if cfg.rollout.server_addrs else cfg.rollout.num_servers
    world = cfg.trainer.world_size
    gpus = ray_gpus(cfg, cluster_gpus)
    return ([Slot(name=server_name(i), role="server", bundle=_bundle(cfg, "server", gpus["server"]))
             for i in range(servers)]
            + [Slot(name="trainer" if world == 1 else f"trainer{r}", role="trainer",
                    bundle=_bundle(cfg, "trainer", gpus["trainer"])) for r in range(world)]
            + [Slot(name="rollout", role="rollout", bundle=dict(CONTROLLER_BUNDLE))])


def total(slots: list[Slot]) -> dict[str, float]:
    out: dict[str, float] = {}
    for slot in slots:
        for key, value in slot.bundle.items():
            out[key] = out.get(key, 0.0) + value
    return out


def plain_resources(resources: dict[str, float]) -> dict[str, float]:
    """Ray's resource dict without per-node and per-placement-group entries."""
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}


def fmt(resources: dict[str, float], always: tuple[str, ...] = ()) -> str:
    """"CPU 5, memory 0.5 GiB": the non-zero resources, plus the `always` keys."""
    parts = []
    for key in ("CPU", "GPU", "memory"):
        value = resources.get(key, 0.0)
        if value or key in always:
            parts.append(f"memory {value / 2**30:.1f} GiB" if key == "memory" else f"{key} {value:g}")
    return ", ".join(parts)


def cannot_place(slots: list[Slot], where: str, free: dict[str, float], why: str = "") -> str:
    """One line: what the run asked for, per role and in all, and what the cluster has."""
    roles: dict[str, list[Slot]] = {}
    for slot in slots:
        roles.setdefault(slot.role, []).append(slot)
    asked = "; ".join(f"{len(group)} {role} x ({fmt(group[0].bundle)})" for role, group in roles.items())
    why = f" ({why})" if why else ""
    return (f"ray: cannot place {len(slots)} bundles [{asked}] = {fmt(total(slots))} on {where}{why}, "
            f"which has {fmt(free, always=('CPU', 'GPU'))} free; lower trainer.world_size, rollout.num_servers "
            "or the ray.num_cpus_per_* / ray.num_gpus_per_* bundle sizes, or use a larger cluster (ray.address)")


class ProcessHost:
    """A Ray actor running one of the run's processes as its child, answering for it."""

    def __init__(self, name: str, run_dir: str):
        self.name, self.run_dir = name, run_dir
        self.cfg: Any = None
        self.proc: Any = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def _gpu_ids(self) -> list:
        import ray

        return list(ray.get_gpu_ids())

    def start(self, entry: str, cfg_yaml: str, kwargs: dict, side: str | None = None) -> None:
        """Start `entry`; a `side` (trainer) process on the GPU Ray assigned this bundle, others on none."""
        cfg = config_from_yaml_text(cfg_yaml)
        slot = ray_slot(cfg, side, self._gpu_ids())
        self.cfg = for_process(cfg, side, slot) if side is not None else cfg
        self.proc = spawn(self.name, entry, self.cfg, env=slot.env(), **kwargs)  # imported in the child: a light actor

    def start_server(self, cfg_yaml: str, index: int) -> str:
        """Start generation server `index` with the launcher registered for `engine.backend`, on the
        GPU Ray assigned this bundle; its URL."""
        from async_rl.launch.external_server import Starting
        from async_rl.launch.servers import SERVER_LAUNCHERS

        cfg = config_from_yaml_text(cfg_yaml)
        slot = ray_slot(cfg, ROLLOUT, self._gpu_ids())
        self.cfg = for_process(cfg, ROLLOUT, slot)
        starting = Starting()
        try:
            self.proc, url = SERVER_LAUNCHERS[self.cfg.engine.backend](self.cfg, index, slot.env(), starting)
        finally:  # tracked from its spawn: an actor that fails or is stopped mid-start can still stop it
            self.proc = self.proc or (starting.procs[-1] if starting.procs else None)
        return url

    def poll(self) -> tuple[int | None, str]:
        """(exit code or None while running / not started, the one-line reason when it failed)."""
        if self.proc is None or self.proc.is_alive():
            return None, ""
        code = self.proc.exitcode
        return code, (child_error(self.cfg, self.proc.name, self.proc) if code else "")

    def stop(self, grace_s: float) -> int | None:
        if self.proc is not None:
            stop_all([self.proc], grace_s=grace_s)
            return self.proc.exitcode
        return None
