"""One weight update across the pool, each server under its own deadline (`weight_sync.deadline_s`).

    stats = await update_servers(pool, receiver, msg, deadline_s=120.0)

The receiver prepares the version once; then every healthy server, concurrently, is
paused, loaded and continued, all within `deadline_s`. A server that misses the deadline
or fails is fenced (out of rotation; the generations on it move to other servers, see
`failover.py`) while the others continue at once. A fenced server rejoins when it has
loaded the current version (the next update includes it again). If no server loads the
version and none is coming back with it (`pool.recovery`, the launcher's server keeper, which
loads the current version into a server it restarts), the run cannot go on:
`WeightUpdateError` says why for each server.

A version can be gone before every server has loaded it: the trainer ran ahead (after a
restart it trains on replayed trajectories at once) and pruned it behind newer ones
(`weight_sync.keep_last`). A load that fails for that reason is no fault of the server. When
no server loaded the version, they all continue at the weights they hold and
`WeightsSuperseded` tells the caller to skip it (the newer version's message is already
sent); when some did, the others are fenced like any server behind the current version, and
rejoin at the next update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from async_rl.protocols import WeightReceiver
from async_rl.rollout.server_pool import Server, ServerPool
from async_rl.utils.logs import one_line
from async_rl.weight_sync.staging import WeightsSuperseded

logger = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """No generation server loaded a weight version."""


def _superseded(receiver: WeightReceiver, prepared: Any, version: int) -> bool:
    try:
        return receiver.superseded(prepared, version)
    except OSError:  # the weights directory itself is gone or unreadable: a failure, not a newer version
        return False


@dataclass
class _Outcome:
    """What one server made of an update: loaded (in `seconds`), fenced, or left paused at its old
    weights because the version was pruned behind a newer one (`superseded`, with `why`)."""

    seconds: float | None = None
    superseded: bool = False
    why: str = ""
    phases: dict[str, float] | None = None  # pause, load, continue: seconds each (a loaded server only)


async def _update_one(pool: ServerPool, receiver: WeightReceiver, server: Server, prepared: Any, version: int,
                      deadline_s: float) -> _Outcome:
    """Pause, load, continue one server within `deadline_s`."""
    t0 = time.perf_counter()
    step = "pause"
    phases: dict[str, float] = {}

    async def sequence() -> None:
        nonlocal step
        t = time.perf_counter()
        for name, call in (("pause", server.client.pause_generation),
                           ("load", lambda: receiver.load(server.client, prepared, version)),
                           ("continue", server.client.continue_generation)):
            step = name
            await call()
            phases[name], t = time.perf_counter() - t, time.perf_counter()

    try:
        await asyncio.wait_for(sequence(), deadline_s)
    except asyncio.TimeoutError:
        pool.fence(server, f"missed the {deadline_s:g}s deadline of weight update v{version} "
                           "(weight_sync.deadline_s)")
        return _Outcome()
    except Exception as exc:  # unreachable, refused the weights, died mid-load: all mean out of rotation
        if step == "load" and _superseded(receiver, prepared, version):
            return _Outcome(superseded=True, why=one_line(exc))  # still paused: update_servers decides
        pool.fence(server, f"weight update v{version} failed: {one_line(exc)}")
        return _Outcome()
    await pool.rejoin(server, version)
    return _Outcome(seconds=time.perf_counter() - t0, phases=phases)


async def _resume_at_old_weights(pool: ServerPool, server: Server, version: int, why: str,
                                 deadline_s: float) -> None:
    """No server loaded `version` (pruned behind a newer one): this one goes on at the weights it holds."""
    try:
        await asyncio.wait_for(server.client.continue_generation(), deadline_s)
    except Exception as exc:
        pool.fence(server, f"weight update v{version} was superseded, then the server did not continue: "
                           f"{one_line(exc)}")
        return
    logger.info("%s: weights v%d skipped, pruned behind a newer version (%s)", server.address, version, why)


async def update_servers(pool: ServerPool, receiver: WeightReceiver, msg: dict[str, Any],
                         deadline_s: float) -> dict[str, float]:
    """Load the version in `msg` into every healthy server of `pool`; returns sync/* metrics."""
    version = int(msg["version"])
    t0 = time.perf_counter()
    prepared = await receiver.prepare(msg)  # WeightsSuperseded too, when it is already gone here
    before = pool.version
    try:
        pool.version = max(pool.version, version)
        for s in pool.servers:
            if not s.healthy:
                pool.fence(s, f"unreachable during weight update v{version} ({s.reason})")
        targets = [s for s in pool.servers if s.healthy]
        outcomes = list(zip(await asyncio.gather(*(_update_one(pool, receiver, s, prepared, version, deadline_s)
                                                    for s in targets)), targets))
    finally:
        await receiver.release(prepared)
    loaded = [o.seconds for o, _ in outcomes if o.seconds is not None]
    skipped = [(s, o) for o, s in outcomes if o.superseded]
    if skipped and not loaded:
        pool.version = before
        await asyncio.gather(*(_resume_at_old_weights(pool, s, version, o.why, deadline_s) for s, o in skipped))
        raise WeightsSuperseded(f"weight update v{version}: pruned behind a newer version before any server "
                                "loaded it (weight_sync.keep_last); the newer one follows; "
                                + "; ".join(s.describe() for s in pool.servers))
    for s, o in skipped:  # the others hold v{version} now: these would generate behind the current version
        pool.fence(s, f"weight update v{version} was pruned behind a newer version before it loaded here "
                      f"({o.why})")
    if not loaded and pool.recovery is not None and await pool.recovery():
        # e.g. the only server was killed mid-update: its restart loads this version before it rejoins
        logger.warning("weight update v%d: no generation server loaded it; the restarting ones load it "
                       "before they rejoin", version)
        return {"sync/update_s": time.perf_counter() - t0, "sync/servers_loaded": 0, "sync/servers_superseded": 0,
                "sync/servers_fenced": len(pool.servers)}
    if not loaded:
        raise WeightUpdateError(f"weight update v{version}: no generation server loaded it: "
                                + "; ".join(s.describe() for s in pool.servers))
    phases = {f"sync/server_{name}_s_max": max(o.phases[name] for o, _ in outcomes if o.phases)
              for name in ("pause", "load", "continue")}
    return {"sync/update_s": time.perf_counter() - t0, "sync/server_update_s_max": max(loaded), **phases,
            "sync/servers_loaded": len(loaded), "sync/servers_superseded": len(skipped),
            "sync/servers_fenced": len(pool.servers) - len(loaded)}
