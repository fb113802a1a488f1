"""`launcher=ray`: the run's processes in one placement group on a Ray cluster.

    async-rl run --config configs/debug_cpu.yaml launcher=ray                          # local cluster, started here
    async-rl run --config configs/debug_cpu.yaml launcher=ray ray.address=HOST:6379    # a running cluster, joined

The placement group has one bundle per generation server (`ray.num_cpus_per_server`, and a
whole GPU where the engine runs on CUDA), one per trainer rank (`ray.num_*_per_trainer`) and
one for the rollout controller (no GPU: it sees none). In each bundle a `ProcessHost` actor (async_rl/launch/ray_host.py) runs the
existing entry point as its own child process, so a process behaves exactly as under
`launcher=local`: its log is `run_dir/logs/<name>.log` and a failure leaves a one-line
`<name>.error`. The driver polls the hosts; the first failure stops everything and becomes
one `error:` line naming the process and its log. Ctrl-C and SIGTERM tear everything down;
a cluster started here is shut down, a joined one is left running. A placement group that
cannot be placed is an error naming the resources, at once on a cluster started here and
after `ray.placement_timeout_s` on a joined one (it may be waiting for nodes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from async_rl.config import Config, ConfigError, save_config, to_yaml
from async_rl.placement import TRAINER, gpus_here
from async_rl.launch.local import RunFailed, summary
from async_rl.launch.procs import named_error, one_line, with_overrides
from async_rl.launch.ray_host import ProcessHost, Slot, cannot_place, plan, plain_resources, total

logger = logging.getLogger(__name__)

LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # only configs and addresses go through Ray's object store
POLL_S = 0.5
ANSWER_S = 60.0  # one poll of a process's actor waits this long for its answer
# an actor that is alive but does not answer (its node overloaded: a server loading, imports on busy cores) is
# waited for this long in all before the run fails; a dead one (ActorDiedError, a lost node) fails it at once
SILENT_LIMIT_S = 300.0
STOP_GRACE_S = 20.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("launcher: `ray` needs Ray installed: .venv/bin/pip install -c constraints.txt -e '.[ray]' "
                          "(or use launcher=local)") from None
    return ray


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _on_sigterm(handler: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the key, when nothing listens at a HOST:PORT `ray.address`."""
    host, _, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"ray.address: no Ray cluster answers at {address} ({exc.strerror or exc}); "
                              "start one with `RAY_AUTH_MODE=disabled ray start --head`") from None


def _connect(ray: Any, cfg: Config) -> tuple[bool, list[Slot]]:
    """Join `ray.address`, or start a local cluster sized to this machine; (started here, the bundles).
    The cluster's GPUs decide where `auto` devices run, so the bundles are planned here."""
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR, "namespace": "async_rl"}
    address = cfg.ray.address
    if address:
        _probe(address)
        try:
            ray.init(address=address, **quiet)
        except Exception as exc:  # Ray raises many kinds; the user needs the key and the address
            raise ConnectionError(f"ray.address: cannot join the Ray cluster at {address} ({one_line(exc)})") from None
        try:
            return False, plan(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
        except BaseException:
            ray.shutdown()
            raise
    visible, _ = gpus_here()
    slots = plan(cfg, visible)
    have = {"CPU": float(os.cpu_count() or 1), "GPU": float(visible)}
    need = total(slots)
    if any(need.get(k, 0.0) > v for k, v in have.items()):  # this cluster cannot grow: say so before starting it
        raise RuntimeError(cannot_place(slots, "this machine", have))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=int(have["CPU"]), num_gpus=int(have["GPU"]), include_dashboard=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    return True, slots


class RayRun:
    """One run on a connected Ray cluster: place, start, supervise, tear down."""

    def __init__(self, ray: Any, cfg: Config, slots: list[Slot]):
        self.ray, self.cfg, self.slots = ray, cfg, slots
        self.pg: Any = None
        self.hosts: dict[str, Any] = {}
        self.servers: list[str] = [s.name for s in slots if s.role == "server"]
        self.trainers: list[str] = [s.name for s in slots if s.role == "trainer"]
        self.dead_servers: set[str] = set()
        self.node_ip: dict[str, str] = {}  # process name -> IP of the node its bundle landed on
        self.multi_node = False
        self.silent_since: dict[str, float] = {}  # process name -> when its actor first left a poll unanswered

    # ------------------------------------------------------------------ placement
    def place(self, started_here: bool) -> None:
        from ray.util.placement_group import placement_group

        self.pg = placement_group([s.bundle for s in self.slots], strategy="PACK",
                                  name=f"async_rl-{Path(self.cfg.run_dir).name}-{uuid.uuid4().hex[:6]}")
        timeout = self.cfg.ray.placement_timeout_s
        ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            where = "the local Ray cluster" if started_here else f"the Ray cluster at {self.cfg.ray.address}"
            free = plain_resources(self.ray.available_resources())
            raise RuntimeError(cannot_place(self.slots, where, free, f"not placed within ray.placement_timeout_s="
                                                                     f"{timeout:g}s"))
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self.ray.remote(ProcessHost)
        for index, slot in enumerate(self.slots):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
            self.hosts[slot.name] = actor.options(
                num_cpus=slot.bundle.get("CPU", 0), num_gpus=slot.bundle.get("GPU", 0),
                memory=slot.bundle.get("memory"), max_concurrency=4,  # poll and stop while a server starts
                scheduling_strategy=strategy).remote(slot.name, self.cfg.run_dir)
        self.node_ip = self._get_all({n: h.node_ip.remote() for n, h in self.hosts.items()})
        nodes = len(set(self.node_ip.values()))
        self.multi_node = nodes > 1
        logger.info("placed %d bundles on %d node(s): %s", len(self.slots), nodes, self.node_ip)

    def _host(self, configured: str, name: str) -> str:
        """An address others can reach: the node's IP instead of loopback when the run spans nodes."""
        return self.node_ip[name] if self.multi_node and configured in _LOOPBACK else configured

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Servers and trainer ranks start together; the rollout side once every server serves."""
        cfg = self.cfg
        servers = self._start_servers()
        addr = cfg.transport.addr
        if addr.startswith("tcp://") and addr.endswith(":0"):
            first = self.trainers[0]
            port = self.ray.get(self.hosts[first].free_port.remote())
            addr = f"tcp://{self._host(addr[len('tcp://'):-2], first)}:{port}"
        # the trainer's threads are those of all its bundles; trainer_rank_main splits them between the ranks
        trainer_cfg = _threads(with_overrides(cfg, transport={"addr": addr}), "trainer",
                               cfg.ray.num_cpus_per_trainer * cfg.trainer.world_size)
        for name, (entry, kwargs) in zip(self.trainers, self._trainer_entries()):
            self.ray.get(self.hosts[name].start.remote(entry, to_yaml(trainer_cfg), kwargs, TRAINER))
        urls = list(self._get_all(servers).values()) if servers else list(cfg.rollout.server_addrs)
        rollout_cfg = with_overrides(cfg, transport={"addr": addr}, rollout={"server_addrs": urls})
        self.ray.get(self.hosts["rollout"].start.remote("async_rl.launch.rollout_proc:rollout_main", to_yaml(rollout_cfg),
                                                        {"servers": []}))  # its servers run in their own bundles
        logger.info("trainer on %s, generation servers %s", addr, urls)

    def _start_servers(self) -> dict[str, Any]:
        """Ask each server host to start its server; the calls' refs by server name (they answer URLs)."""
        refs = {}
        for index, name in enumerate(self.servers):
            port = self.cfg.engine.port + index if self.cfg.engine.port else 0  # as on one machine: port, port+1, ...
            scfg = with_overrides(self.cfg, engine={"host": self._host(self.cfg.engine.host, name), "port": port})
            scfg = _threads(scfg, "engine", self.cfg.ray.num_cpus_per_server)
            refs[name] = self.hosts[name].start_server.remote(to_yaml(scfg), index)
        return refs

    def _trainer_entries(self) -> list[tuple[str, dict]]:
        """One entry per rank; rank 0 hosts the ranks' rendezvous store on its node."""
        world = self.cfg.trainer.world_size
        if world == 1:
            return [("async_rl.launch.trainer_proc:trainer_main", {})]
        rank0 = self.trainers[0]
        master_addr = self._host("127.0.0.1", rank0)
        master_port = self.ray.get(self.hosts[rank0].free_port.remote())
        # each rank runs on the GPU Ray assigned its bundle (ProcessHost.start: its slot, cuda:0 in the process)
        return [("async_rl.launch.trainer_proc:trainer_rank_main",
                 {"rank": r, "world_size": world, "master_addr": master_addr, "master_port": master_port})
                for r in range(world)]

    def _get_all(self, refs: dict[str, Any]) -> dict[str, Any]:
        """Wait for every named call, watching the running processes meanwhile; fail with the first error."""
        out: dict[str, Any] = {}
        pending = {ref: name for name, ref in refs.items()}
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                name = pending.pop(ref)
                try:
                    out[name] = self.ray.get(ref)
                except self.ray.exceptions.RayTaskError as exc:
                    why = one_line(exc.cause or exc)  # a server launcher's errors already name the server
                    raise RunFailed(why if why.startswith(f"{name}:") else f"{name}: {why}") from None
                except self.ray.exceptions.RayActorError:
                    raise RunFailed(self._actor_died(name)) from None
            self._check()
        return {name: out[name] for name in refs}

    # ------------------------------------------------------------------ supervision
    def _actor_died(self, name: str) -> str:
        return named_error(self.cfg, name, "its Ray actor died (node lost or killed)")

    def _check(self) -> dict[str, int | None]:
        """Exit codes of the started processes (None = running or not heard from); raise RunFailed on a failure."""
        codes: dict[str, int | None] = {}
        errors = self.ray.exceptions
        for name, host in self.hosts.items():
            try:
                code, why = self.ray.get(host.poll.remote(), timeout=ANSWER_S)
            except (errors.ActorUnavailableError, errors.GetTimeoutError) as exc:  # not known dead: wait on
                now = time.monotonic()
                silent = now - self.silent_since.setdefault(
                    name, now - (ANSWER_S if isinstance(exc, errors.GetTimeoutError) else 0.0))
                if silent >= SILENT_LIMIT_S:
                    raise RunFailed(named_error(self.cfg, name, f"its Ray actor has not answered for {silent:.0f} s "
                                                                "(its node overloaded or unreachable)")) from None
                codes[name] = None
                continue
            except errors.RayActorError:
                raise RunFailed(self._actor_died(name)) from None
            self.silent_since.pop(name, None)
            codes[name] = code
            if code is None or (code == 0 and name not in self.servers):
                continue
            if name in self.servers and len(self.dead_servers | {name}) < len(self.servers):
                if name not in self.dead_servers:  # the rollout side's pool takes it out of rotation
                    logger.warning("%s; the rollout side takes it out of rotation", why)
                    self.dead_servers.add(name)
                continue
            raise RunFailed(why)
        return codes

    def supervise(self) -> None:
        """Until the trainer ranks and the rollout side have exited 0; the servers are stopped after."""
        finish_s = self.cfg.rollout.connect_timeout_s + 300
        done_at: float | None = None
        while True:
            codes = self._check()
            if all(codes[n] == 0 for n in self.trainers):
                if codes["rollout"] == 0:
                    return
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > finish_s:
                    logger.warning("rollout did not finish %.0fs after the trainer; stopping it", finish_s)
                    return
            time.sleep(POLL_S)

    def teardown(self) -> None:
        """Stop the processes (rollout first, servers last), end the actors, free the bundles. Trainer rank 0
        stops before its followers: it checkpoints with them and then tells them to stop, where followers
        stopped alongside it would leave its last collectives, and its wait for them, to the grace period."""
        for group in (["rollout"], self.trainers[:1], self.trainers[1:], self.servers):
            refs = [self.hosts[n].stop.remote(STOP_GRACE_S) for n in group if n in self.hosts]
            if refs:
                self.ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 10)
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                self.ray.kill(host)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)


def _threads(cfg: Config, section: str, bundle_cpus: float) -> Config:
    """A process uses the CPUs of its bundle unless `<section>.num_threads` says otherwise."""
    if getattr(cfg, section).num_threads > 0:
        return cfg
    return with_overrides(cfg, **{section: {"num_threads": max(1, int(bundle_cpus))}})


def _check_backend(cfg: Config) -> None:
    """Ranks are placed on the cluster, so only the config is checked here, not this machine's devices."""
    from async_rl.trainer.backends import TRAINER_BACKENDS

    if cfg.trainer.world_size > 1 and not TRAINER_BACKENDS[cfg.trainer.backend]().distributed:
        raise ConfigError(f"trainer.world_size: trainer.backend={cfg.trainer.backend} runs one process, got "
                          f"{cfg.trainer.world_size}; use trainer.backend=fsdp or megatron to place several ranks")


def run_ray(cfg: Config) -> list[str]:
    ray = _import_ray()
    _check_backend(cfg)
    started_here, slots = _connect(ray, cfg)
    save_config(cfg, cfg.run_dir)
    for stale in ("metrics.jsonl", "eval.jsonl", "rollout_metrics.jsonl"):
        (Path(cfg.run_dir) / stale).unlink(missing_ok=True)
    previous = signal.getsignal(signal.SIGTERM)
    run = RayRun(ray, cfg, slots)
    try:
        _on_sigterm(_raise_interrupt)  # SIGTERM tears down like Ctrl-C; set after ray.init, which installs its own
        run.place(started_here)
        run.start()
        run.supervise()
    finally:
        run.teardown()
        ray.shutdown()  # stops a cluster started here; only disconnects from a joined one
        _on_sigterm(previous)
    where = "a local Ray cluster (started and stopped here)" if started_here else \
        f"the Ray cluster at {cfg.ray.address}"
    return [f"ray: {len(slots)} bundles placed on {where}", *summary(cfg)]
