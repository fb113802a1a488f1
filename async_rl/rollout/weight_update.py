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
(`weight_sync.keep_last`). A load that fails for that reason is no fault of the server: it
continues at the weights it holds, unfenced, and when no server loaded the version,
`WeightsSuperseded` tells the caller to skip it; the newer version's message is already sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from async_rl.protocols import WeightReceiver
from async_rl.rollout.server_pool import Server, ServerPool
from async_rl.weight_sync.staging import WeightsSuperseded

logger = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """No generation server loaded a weight version."""


SUPERSEDED = "superseded"


async def _update_one(pool: ServerPool, receiver: WeightReceiver, server: Server, prepared: Any, version: int,
                      deadline_s: float) -> float | str | None:
    """Pause, load, continue one server; its seconds, SUPERSEDED when the version was pruned behind a
    newer one (the server continues at what it holds), or None when it was fenced."""
    t0 = time.perf_counter()

    async def sequence() -> None:
        await server.client.pause_generation()
        await receiver.load(server.client, prepared, version)
        await server.client.continue_generation()

    try:
        await asyncio.wait_for(sequence(), deadline_s)
    except asyncio.TimeoutError:
        pool.fence(server, f"missed the {deadline_s:g}s deadline of weight update v{version} "
                           "(weight_sync.deadline_s)")
        return None
    except Exception as exc:  # unreachable, refused the weights, died mid-load: all mean out of rotation
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if receiver.superseded(prepared, version):
            try:
                await asyncio.wait_for(server.client.continue_generation(), deadline_s)
            except Exception as again:
                pool.fence(server, f"weight update v{version} was superseded, then the server did not "
                                   f"continue: {(str(again).strip().splitlines() or [type(again).__name__])[0]}")
                return None
            logger.info("%s: weights v%d skipped, pruned behind a newer version (%s)", server.address, version, first)
            return SUPERSEDED
        pool.fence(server, f"weight update v{version} failed: {first}")
        return None
    await pool.rejoin(server, version)
    return time.perf_counter() - t0


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
        took = await asyncio.gather(*(_update_one(pool, receiver, s, prepared, version, deadline_s)
                                      for s in targets))
    finally:
        await receiver.release(prepared)
    loaded = [t for t in took if isinstance(t, float)]
    skipped = took.count(SUPERSEDED)
    if not loaded and skipped:
        pool.version = before
        raise WeightsSuperseded(f"weight update v{version}: pruned behind a newer version before any server "
                                "loaded it (weight_sync.keep_last); the newer one follows")
    if not loaded and pool.recovery is not None and await pool.recovery():
        # e.g. the only server was killed mid-update: its restart loads this version before it rejoins
        logger.warning("weight update v%d: no generation server loaded it; the restarting ones load it "
                       "before they rejoin", version)
        return {"sync/update_s": time.perf_counter() - t0, "sync/servers_loaded": 0,
                "sync/servers_fenced": len(pool.servers)}
    if not loaded:
        raise WeightUpdateError(f"weight update v{version}: no generation server loaded it: "
                                + "; ".join(s.describe() for s in pool.servers))
    return {"sync/update_s": time.perf_counter() - t0, "sync/server_update_s_max": max(loaded),
            "sync/servers_loaded": len(loaded), "sync/servers_superseded": skipped,
            "sync/servers_fenced": len(pool.servers) - len(loaded) - skipped}
