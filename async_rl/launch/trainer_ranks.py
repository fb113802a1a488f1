"""The trainer's ranks: rank 0 leads, ranks 1..N-1 follow it in lock step.

    trainer = lead(cfg, world_size, master_addr, master_port)       # rank 0 (async_rl/launch/trainer_proc.py)
    follow(cfg, rank, world_size, master_addr, master_port)          # ranks 1..N-1, until rank 0 stops

Rank 0 owns the queue, metrics, checkpoints and publishing and hosts a TCPStore at
master_addr:master_port. The store carries the process group's rendezvous and a command
channel: every call rank 0 makes on the trainer (`train_step`, `state_dict`, `weights`,
`save_checkpoint`, `load_checkpoint`, `close`) is first written there as one small msgpack
frame (its name and arguments: paths, steps), then run locally; each follower reads the
command, runs the same call, and so joins the same collectives (so a resume loads every
rank's shard and the same RNG on every rank). A train step's data is not in the frame: rank
0's `train_step` sends each follower its rows of the batch over the process group itself
(trainer/backends/spmd.py), and the follower's `follow_train_step` receives them. A follower waits for commands
without a timeout while rank 0 waits for rollout data, and leaves as soon as the store's
connection breaks (rank 0 died) or it reads `stop`. Collectives themselves
time out after `transport.peer_timeout_s`, so a rank that dies mid-step fails the others
instead of hanging them.

For one rank (`trainer.world_size=1`) there is no store and no channel: `lead` returns the
backend's trainer itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from async_rl.config import Config
from async_rl.placement import rank_device
from async_rl.trainer.backends import RankInfo, TrainerBackend, get_backend
from async_rl.transport.codec import decode, encode
from async_rl.types import Trajectory
from async_rl.launch.common import effective_threads, free_port
from async_rl.launch.procs import child_error, spawn, stop_all, with_overrides

logger = logging.getLogger(__name__)

_POLL_S = (0.002, 0.05)  # a follower polls for the next command, backing off from the first to the second
_CMD = "cmd/{}"
_ACK = "ack/{}"  # followers that have read command n; its frame is deleted once all have
_STOPPED = "stopped"


class LeaderLost(RuntimeError):
    """Rank 0 went away (its store closed) while this rank was waiting for a command."""


def rank_threads(cfg: Config, world_size: int) -> int:
    """Torch threads of one rank: the trainer's threads split between its ranks, at least 1."""
    return max(1, effective_threads(cfg.trainer.num_threads, cfg.mode) // world_size)


def open_store(cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int) -> dist.TCPStore:
    """Rank 0 hosts the store, the others connect (retrying until transport.peer_timeout_s)."""
    return dist.TCPStore(master_addr, master_port, world_size, rank == 0, wait_for_workers=False,
                         timeout=timedelta(seconds=cfg.transport.peer_timeout_s))


def rank_cfg(cfg: Config, rank: int, local_rank: int | None) -> Config:
    """The config rank `rank` builds its trainer with: its own device (async_rl.placement.rank_device)."""
    device = rank_device(cfg.trainer.device, rank if local_rank is None else local_rank)
    return with_overrides(cfg, trainer={"device": device})


def _rank_info(cfg: Config, rank: int, world_size: int, store: Any, local_rank: int | None) -> RankInfo:
    return RankInfo(rank=rank, world_size=world_size, store=store, local_rank=local_rank,
                    timeout_s=cfg.transport.peer_timeout_s)


class Leader:
    """Rank 0's trainer: each call is announced to the followers, then run here (same interface)."""

    def __init__(self, trainer: TrainerBackend, store: dist.TCPStore, world_size: int,
                 check_followers: Callable[[], None] | None = None, stop_timeout_s: float = 30.0):
        self.trainer = trainer
        self.store = store
        self.world_size = world_size
        self.check_followers = check_followers  # raises if a locally started rank died
        self.stop_timeout_s = stop_timeout_s
        self._seq = 0
        self._unread: list[int] = []  # commands some follower may not have read yet
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def hf_export(self) -> Any:
        return self.trainer.hf_export

    def train_step(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        self._announce("train_step")  # the batch follows over the process group (spmd.py), not the store
        return self.trainer.train_step(groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._announce("state_dict")
        return self.trainer.state_dict()

    def weights(self) -> Any:
        """The weights as a source rank 0 publishes from; the followers gather along (`WeightSource.close`)."""
        self._announce("weights")
        return self.trainer.weights()

    def rng_state(self) -> dict[str, Any]:
        return self.trainer.rng_state()  # every rank draws the same minibatch assignments: rank 0 speaks for all

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Every rank loads its shard of the checkpoint (each reads the files: run_dir must be on a
        file system all ranks see) and restores the same version and RNG; returns the meta."""
        self._announce("load_checkpoint", path=path)
        return self.trainer.load_checkpoint(path)

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None:
        self._announce("save_checkpoint", path=path, step=step, extra=extra)
        self.trainer.save_checkpoint(path, step, extra)

    def close(self) -> None:
        """Tell the followers to stop, wait until they have (bounded), leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            self._seq += 1  # not _announce: a dead follower must not keep the others from hearing `stop`
            self.store.set(_CMD.format(self._seq), encode({"op": "stop"}))
            deadline = time.monotonic() + self.stop_timeout_s
            while self.store.add(_STOPPED, 0) < self.world_size - 1 and time.monotonic() < deadline:
                if not self._followers_alive():
                    break
                time.sleep(0.05)
        finally:
            self.trainer.close()

    def _followers_alive(self) -> bool:
        try:
            if self.check_followers is not None:
                self.check_followers()
            return True
        except RuntimeError:
            return False

    def _announce(self, op: str, **args: Any) -> None:
        if self.check_followers is not None:
            self.check_followers()
        self._forget_read()
        self._seq += 1
        self.store.set(_CMD.format(self._seq), encode({"op": op, **args}))
        self._unread.append(self._seq)

    def _forget_read(self) -> None:
        """Delete the frames every follower has read (a step may have no collective to wait on)."""
        for seq in list(self._unread):
            if self.store.add(_ACK.format(seq), 0) >= self.world_size - 1:
                self.store.delete_key(_CMD.format(seq))
                self.store.delete_key(_ACK.format(seq))
                self._unread.remove(seq)


# what a follower does for each command of rank 0 (the same call, so the same collectives)
_COMMANDS: dict[str, Callable[[TrainerBackend, dict[str, Any]], Any]] = {
    "train_step": lambda t, c: t.follow_train_step(),
    "state_dict": lambda t, c: t.state_dict(),
    "weights": lambda t, c: t.weights().close(),
    "save_checkpoint": lambda t, c: t.save_checkpoint(c["path"], c["step"], c["extra"]),
    "load_checkpoint": lambda t, c: t.load_checkpoint(c["path"]),
}


def _next_command(store: dist.TCPStore, seq: int) -> dict[str, Any]:
    """Poll (store.wait's timeouts would log a warning each): rank 0 may wait minutes for rollout data."""
    key, pause = _CMD.format(seq), _POLL_S[0]
    try:
        while not store.check([key]):
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        cmd = decode(store.get(key))
        store.add(_ACK.format(seq), 1)
        return cmd
    except dist.DistNetworkError:
        raise LeaderLost("trainer rank 0 went away (its store closed); stopping this rank") from None


def follow(cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int,
           local_rank: int | None = None) -> None:
    """Ranks 1..N-1: build the same trainer, then run rank 0's commands until it says stop."""
    store = open_store(cfg, rank, world_size, master_addr, master_port)
    trainer = get_backend(cfg.trainer.backend).build(rank_cfg(cfg, rank, local_rank),
                                                     _rank_info(cfg, rank, world_size, store, local_rank))
    seq = 0
    try:
        while True:
            seq += 1
            cmd = _next_command(store, seq)
            if cmd["op"] == "stop":
                logger.info("trainer rank %d: stop after %d commands", rank, seq - 1)
                store.add(_STOPPED, 1)
                return
            if cmd["op"] not in _COMMANDS:
                raise ValueError(f"trainer rank {rank}: unknown command {cmd['op']!r} from rank 0")
            _COMMANDS[cmd["op"]](trainer, cmd)
    finally:
        trainer.close()


def lead(cfg: Config, world_size: int, master_addr: str, master_port: int, local_rank: int | None = None,
         check_followers: Callable[[], None] | None = None) -> TrainerBackend:
    """Rank 0's trainer: the backend's own for one rank, else a `Leader` over the process group."""
    spec = get_backend(cfg.trainer.backend)
    store = open_store(cfg, 0, world_size, master_addr, master_port) if spec.distributed else None
    trainer = spec.build(rank_cfg(cfg, 0, local_rank), _rank_info(cfg, 0, world_size, store, local_rank))
    if world_size == 1:
        return trainer
    return Leader(trainer, store, world_size, check_followers=check_followers)


def follower_main(cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                  local_rank: int | None = None) -> None:
    """Body of a rank 1..N-1 process (a child of rank 0, or placed by a launcher)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(rank_threads(cfg, world_size))
    follow(cfg, rank, world_size, master_addr, master_port, local_rank)


@contextlib.contextmanager
def local_followers(cfg: Config) -> Iterator[tuple[str, int, Callable[[], None] | None]]:
    """Start ranks 1..trainer.world_size-1 as child processes of this one (rank 0) and stop them after.

    Yields (master_addr, master_port, check_followers): the last raises with a follower's
    own error line when one has died. The backend's device check runs first, so a world
    size this machine cannot hold fails before anything starts.
    """
    get_backend(cfg.trainer.backend).check(cfg)
    n = cfg.trainer.world_size
    if n == 1:
        yield "127.0.0.1", 0, None
        return
    addr, port = "127.0.0.1", free_port()
    procs = {f"trainer_rank{r}": spawn(f"trainer_rank{r}", "async_rl.launch.trainer_ranks:follower_main", cfg, rank=r,
                                       world_size=n, master_addr=addr, master_port=port) for r in range(1, n)}

    def check_followers() -> None:
        for name, proc in procs.items():
            if not proc.is_alive():
                raise RuntimeError(child_error(cfg, name, proc))

    def failed_follower() -> RuntimeError | None:
        for name, proc in procs.items():
            if not proc.is_alive() and proc.exitcode not in (0, None):
                return RuntimeError(child_error(cfg, name, proc))
        return None

    try:
        yield addr, port, check_followers
    except BaseException:
        time.sleep(0.5)  # a follower that failed first explains the failure better than rank 0's broken collective
        if (err := failed_follower()) is not None:
            raise err from None
        raise
    finally:
        deadline = time.monotonic() + 30.0  # rank 0 said stop (trainer.close()): they are leaving
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        stop_all(list(procs.values()), grace_s=5.0)
    if (err := failed_follower()) is not None:
        raise err
