"""The staleness gate never admits beyond (v + eta + 1) * B, and admits up to it."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.rollout.staleness import StalenessGate


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), eta=st.integers(0, 8), unit=st.integers(1, 16),
       events=st.lists(st.sampled_from(["admit", "version"]), max_size=200))
def test_never_admits_beyond_bound(batch, eta, unit, events):
    gate = StalenessGate(batch, eta)
    for ev in events:
        if ev == "version":
            gate.set_version(gate.version + 1)
        elif gate.can_admit(unit):
            gate.admit(unit)
        assert gate.admitted <= (gate.version + eta + 1) * batch
    # the gate is not merely closed: it fills up to within one unit of its bound
    while gate.can_admit(unit):
        gate.admit(unit)
    assert gate.limit - unit < gate.admitted <= gate.limit


def test_admit_over_bound_raises():
    gate = StalenessGate(batch_size=8, max_staleness=0)
    gate.admit(8)
    with pytest.raises(RuntimeError, match="exceed"):
        gate.admit(1)


def test_wait_admit_blocks_until_version_advances():
    async def scenario():
        gate = StalenessGate(batch_size=4, max_staleness=1)
        await gate.wait_admit(4)
        await gate.wait_admit(4)  # (0 + 1 + 1) * 4 = 8 admitted: full
        waiter = asyncio.create_task(gate.wait_admit(4))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.set_version(1)
        await asyncio.wait_for(waiter, 1.0)
        assert gate.admitted == 12

    asyncio.run(scenario())


def test_unit_that_can_never_fit_is_rejected():
    gate = StalenessGate(batch_size=4, max_staleness=0)
    with pytest.raises(ValueError, match="never fit"):
        asyncio.run(gate.wait_admit(5))


def test_versions_only_move_forward():
    gate = StalenessGate(batch_size=4, max_staleness=0, version=3)
    gate.set_version(1)
    assert gate.version == 3


def test_stale_attempts_are_those_begun_more_than_eta_versions_before():
    gate = StalenessGate(batch_size=4, max_staleness=1)
    started = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert gate.stale_attempts(started, 3) == ["a", "b"]
    assert gate.stale_attempts(started, 2) == ["a"]
    assert StalenessGate(4, 0).stale_attempts(started, 3) == ["a", "b", "c"]


def test_try_admit_admits_only_what_fits_and_refuses_a_unit_that_never_can():
    gate = StalenessGate(batch_size=4, max_staleness=0)
    assert gate.try_admit(4) and gate.admitted == 4
    assert not gate.try_admit(4) and gate.admitted == 4
    with pytest.raises(ValueError, match="never fit"):
        gate.try_admit(5)


def test_for_config_forces_eta_zero_in_sync_mode():
    from async_rl.config import load_config

    assert StalenessGate.for_config(load_config(None, ["mode=async", "max_staleness=3"])).max_staleness == 3
    assert StalenessGate.for_config(load_config(None, ["mode=sync", "max_staleness=3"])).max_staleness == 0
