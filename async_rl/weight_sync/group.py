"""The `dist` weight group: formed the way SGLang forms it, waited on under a deadline, aborted on failure.

SGLang joins a weight-update group in `init_custom_process_group` (sglang 0.5.23,
`srt/utils/common.py`, lines 2859-2927): `rendezvous("tcp://HOST:PORT")` gives a TCPStore
client, wrapped in `PrefixStore(group_name)`, then torch's `_new_process_group_helper`
adds `PrefixStore(f"{group_name}/")` and one per device (`cpu/` for gloo, `cuda/` for
NCCL) and, for gloo, syncs a sequence number through the store. Ranks that build their
side any other way write their keys elsewhere and never meet, so the trainer (rank 0,
which hosts the store) goes through the same torch helper (`new_group`), and the embedded
server, which may hold several groups of one name in one process (tests run two servers in
one), builds the same store chain and backend by hand (`join_group`).

Failures. A gloo collective raises once the group's timeout passes; an NCCL one does not
(`work.wait()` only orders streams), so `wait` polls the work against the deadline, and an
NCCL group is built with `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (the watchdog aborts the
communicator instead of killing the process) and non-blocking communicator init, its watchdog
timeout a margin beyond the deadline as a backstop. Torch creates an NCCL communicator lazily,
at the group's first collective, and decides then whether it is non-blocking
(`ProcessGroupNCCL::useNonblocking`: the group's own `config.blocking` first, the environment
variable TORCH_NCCL_USE_COMM_NONBLOCKING second, read at that moment): so it is the group's
option (`_nccl_options`), not an environment set while the group object is built and gone by the
first broadcast. A non-blocking init then waits for the peers at most
TORCH_NCCL_NONBLOCKING_TIMEOUT seconds (read once per process, default 30 minutes): it is set to
the deadline before the first group is built, so a server that never joins fails the publish
within `weight_sync.deadline_s` and is fenced. A group that failed is aborted (`abort`), never just
dropped. Whatever holds groups registers its close with `close_at_exit` (groups are aborted
then: a peer may be gone, and NCCL's destroy can wait on it): a group still alive when the
interpreter finalizes takes its gloo run-loop threads down with it, and one that reaches for the
GIL then is made to exit mid-C++, aborting a process whose run succeeded ("terminate called
without an active exception", exit -6). Closing is not enough: the group must be dropped (its
threads end only with the object), so the holder's close lets go of it. NCCL has not run in
this project yet: these paths follow torch's and NCCL's documented rules and carry
`gpu`-marked tests.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from async_rl.weight_sync.staging import WeightSyncError

BACKENDS = ("gloo", "nccl")
NCCL_WATCHDOG_MARGIN_S = 30.0  # the watchdog fires this long after our own deadline: a backstop only
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # read when the group object is built
_POLL_S = 0.001
_HOLDERS: list[weakref.WeakMethod] = []  # close methods of objects holding groups, run at exit
_EXITING = False  # set while the holders close at exit: groups are aborted then, never destroyed


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise WeightSyncError(f"backend: {backend!r} is not supported (allowed: {', '.join(BACKENDS)})")
    if backend == "nccl" and (not dist.is_nccl_available() or not torch.cuda.is_available()):
        raise WeightSyncError("backend: nccl needs CUDA and a torch built with NCCL; use gloo on CPU")
    return backend


def choose_backend(trainer_device: torch.device | str, engine_devices: list[str]) -> str:
    """NCCL only when both ends hold the weights on CUDA; gloo otherwise. Gloo moves CUDA tensors
    through host memory itself, so a CUDA trainer and a CPU engine (or the reverse) meet over it;
    NCCL cannot take a CPU tensor at all."""
    if torch.device(trainer_device).type == "cuda" and engine_devices and all(d == "cuda" for d in engine_devices):
        return "nccl"
    return "gloo"


def _timeout(backend: str, timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s + (NCCL_WATCHDOG_MARGIN_S if backend == "nccl" else 0.0))


@contextlib.contextmanager
def _nccl_env(backend: str) -> Iterator[None]:
    """ProcessGroupNCCL reads these when it is built; set them for our group only."""
    if backend != "nccl":
        yield
        return
    saved = {k: os.environ.get(k) for k in _NCCL_ENV}
    os.environ.update(_NCCL_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nccl_options(timeout: datetime.timedelta) -> Any:
    """Options of one NCCL group: non-blocking communicator init decided by the group itself (see the module
    docstring), and the init's wait for peers bounded by the deadline (a process-wide setting torch reads once,
    at the first non-blocking init: set before it unless the user set it)."""
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, math.ceil(timeout.total_seconds()
                                                                              - NCCL_WATCHDOG_MARGIN_S))))
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.config.blocking = 0
    return opts


@contextlib.contextmanager
def _no_split() -> Iterator[None]:
    """`_new_process_group_helper` splits a new NCCL group from the default group when that one is bound
    to a device (the FSDP trainer's is): the weight group's ranks are other processes, so it must not."""
    default = c10d.GroupMember.WORLD if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def _failed(what: str, timeout_s: float, exc: BaseException) -> WeightSyncError:
    return WeightSyncError(f"{what} (weight_sync.deadline_s={timeout_s:g}s): {str(exc).splitlines()[0][:200]}")


def new_group(backend: str, store: Any, group_name: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """This process's side of the group, through torch's helper exactly as SGLang's
    `init_custom_process_group` calls it after its rendezvous (the store wrapped in
    `PrefixStore(group_name)`, no split, ranks 0..world_size-1). Registered in torch's group
    table under `group_name` (one per process); `close(group)` unregisters it."""
    check_backend(backend)
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank_offset: rank {rank} does not fit world_size {world_size}")
    timeout = _timeout(backend, timeout_s)
    store.set_timeout(timeout)
    try:
        with _nccl_env(backend), _no_split():
            pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                                   dist.PrefixStore(group_name, store), group_name=group_name,
                                                   backend_options=_nccl_options(timeout) if backend == "nccl"
                                                   else None, timeout=timeout, device_id=None)
    except (RuntimeError, ValueError) as exc:
        raise _failed(f"group {group_name!r}: rank {rank} of {world_size} could not join", timeout_s, exc) from None
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def join_group(backend: str, master_address: str, master_port: int, group_name: str, rank: int, world_size: int,
               timeout_s: float) -> Any:
    """A server's side of the group, with the same store keys as `new_group` (and SGLang): torch's
    `rendezvous` client store, `PrefixStore(group_name)`, `PrefixStore(f"{group_name}/")`, the device
    prefix, the backend, its sequence number. Not registered in torch's group table, so one process
    may hold several groups of one name (several embedded servers in one test process)."""
    check_backend(backend)
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank_offset: rank {rank} does not fit world_size {world_size}")
    timeout = _timeout(backend, timeout_s)
    try:
        store, _, _ = next(c10d.rendezvous(f"tcp://{_bracket(master_address)}:{master_port}", rank, world_size,
                                           timeout=timeout))
    except (RuntimeError, ValueError) as exc:
        raise _failed(f"master_address: cannot reach the trainer's store at {master_address}:{master_port}",
                      timeout_s, exc) from None
    store.set_timeout(timeout)
    device = "cuda" if backend == "nccl" else "cpu"  # BackendConfig's first device for the backend
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    try:
        with _nccl_env(backend):
            if backend == "gloo":
                group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            else:
                group = dist.ProcessGroupNCCL(prefixed, rank, world_size, _nccl_options(timeout))
            group._set_sequence_number_for_group()
    except (RuntimeError, ValueError) as exc:
        raise _failed(f"group {group_name!r}: rank {rank} of {world_size} could not join", timeout_s, exc) from None
    return group


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def broadcast(group: Any, tensor: torch.Tensor, what: str, timeout_s: float, deadline: float | None = None) -> None:
    """Broadcast `tensor` from rank 0 and wait for it, at most until `deadline` (time.monotonic(); default
    `timeout_s` from now). WeightSyncError naming `what` on failure; the caller then aborts the group."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    try:
        work = group.broadcast(tensor, 0)
        if tensor.device.type == "cuda":  # NCCL (or gloo on CUDA): wait() would not block; poll instead
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("the broadcast did not complete (a peer is gone or stuck)")
                time.sleep(_POLL_S)
        work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))  # gloo: bounded here
    except (RuntimeError, TimeoutError) as exc:
        raise _failed(f"{what}: broadcast failed or timed out", timeout_s, exc) from None


def close(group: Any, failed: bool = False) -> None:
    """Release a group: aborted when it failed (a peer may be stuck in it), destroyed otherwise."""
    if group is None:
        return
    failed = failed or _EXITING
    registered = group in c10d._world.pg_map
    try:
        if failed and registered:
            c10d._abort_process_group(group)
        elif failed:
            group.abort()
        elif registered:
            dist.destroy_process_group(group)
        else:
            group.shutdown()
    except (RuntimeError, ValueError, KeyError, AttributeError):  # best effort: it is dropped either way
        pass


def close_at_exit(method: Any) -> None:
    """Run `method` (the bound close of an object holding groups, which drops them) before the interpreter
    finalizes, if that object is still alive then; held weakly, so it does not keep the object alive."""
    _HOLDERS[:] = [ref for ref in _HOLDERS if ref() is not None]
    _HOLDERS.append(weakref.WeakMethod(method))


@atexit.register
def _close_holders() -> None:
    global _EXITING
    _EXITING = True  # a peer may be gone by now: NCCL's destroy can wait on it, abort never does
    for ref in _HOLDERS:
        if (method := ref()) is not None:
            method()
