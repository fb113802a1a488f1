"""ServerPool.acquire while no server is in rotation: it times out with a clear error, wakes when one
rejoins, and a cancellation (the rollout side stopping) leaves the pool's lock as it found it.

A clean-clone CI run once failed on the last: a request task cancelled twice while it waited
(once by its own stop, once by the controller's) left acquire's `async with` without holding the
lock and released the lock another task held ("Lock is not acquired")."""

import asyncio
from types import SimpleNamespace

import pytest

from async_rl.rollout.server_pool import NoServerError, ServerPool


def down_pool() -> ServerPool:
    pool = ServerPool([SimpleNamespace(address="http://127.0.0.1:1")])
    server = pool.servers[0]
    server.healthy, server.reason = False, "unreachable (test)"
    return pool


# a cancellation, then the loop turns this many times before the next one (or the release);
# with wait_for, (1, 1) and (2, 1) released the holder's lock
GAPS = [(1,), (2,), (1, 0), (1, 1), (1, 2), (2, 1), (1, 1, 1)]


@pytest.mark.parametrize("gaps", GAPS, ids=str)
def test_cancelled_acquire_leaves_the_lock_to_its_holder(gaps):
    async def main():
        pool = down_pool()
        waiter = asyncio.create_task(pool.acquire(timeout_s=30))
        await asyncio.sleep(0.01)  # waiting on the condition
        cond = pool._cond()
        await cond.acquire()  # another task holds the lock, so the waiter must queue to retake it
        for gap in gaps:
            waiter.cancel()
            for _ in range(gap):
                await asyncio.sleep(0)
        cond.release()  # raised "Lock is not acquired" when the waiter had released it
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not cond.locked()
        pool.servers[0].healthy = True  # the pool still works afterwards
        server = await pool.acquire(timeout_s=1)
        assert server is pool.servers[0] and server.in_flight == 1

    asyncio.run(main())


def test_acquire_times_out_naming_the_servers():
    async def main():
        with pytest.raises(NoServerError, match=r"for 0.05s .*127.0.0.1:1: unreachable \(test\)"):
            await down_pool().acquire(timeout_s=0.05)

    asyncio.run(main())


def test_acquire_wakes_when_a_server_rejoins():
    async def main():
        pool = down_pool()
        waiter = asyncio.create_task(pool.acquire(timeout_s=30))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        pool.servers[0].healthy = True
        await pool._notify()
        server = await asyncio.wait_for(waiter, 30)  # a hang guard: it returns at once
        assert server is pool.servers[0]

    asyncio.run(main())
