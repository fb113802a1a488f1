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
        await asyncio.wait_for(waiter, 30.0)  # a hang guard: it returns at once
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


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), eta=st.integers(1, 8), unit=st.integers(1, 16),
       events=st.lists(st.one_of(st.sampled_from(["admit", "version"]), st.integers(0, 600)), max_size=200))
def test_a_paced_gate_stays_under_the_bound_and_uses_between_one_and_eta_versions_of_it(batch, eta, unit, events):
    """rollout.pace moves how far ahead admission runs (an int event: what the trainer found ready)
    but never past eta."""
    gate = StalenessGate(batch, eta, pace=True)
    for ev in events:
        if ev == "version":
            gate.set_version(gate.version + 1)
        elif ev == "admit":
            if gate.can_admit(unit):
                gate.admit(unit)
        else:
            gate.pace(ev)
        assert 1 <= gate.ahead <= eta
        assert gate.limit == (gate.version + gate.ahead + 1) * batch <= (gate.version + eta + 1) * batch


def test_pacing_runs_one_version_less_after_a_pipeline_without_waits_and_one_more_when_the_trainer_waited():
    b = 8
    gate = StalenessGate(b, 4, pace=True)
    assert (gate.ahead, gate.limit) == (4, 5 * b)  # starts at the bound: the pipeline fills first
    steps = [(2 * b, 4), (2 * b, 4), (2 * b, 4), (2 * b, 4),  # 4 asks fed: not yet more than `ahead`
             (2 * b, 3), (2 * b, 2),  # calm for a pipeline's worth, a batch to spare: one less each ask
             (b, 2), (2 * b, 1), (9 * b, 1),  # nothing to spare: hold; never below 1
             (b - 1, 2), (2 * b, 2),  # the trainer waited: one more, and the count of calm asks restarts
             (0, 3), (0, 4), (0, 4)]  # never above eta
    for buffered, ahead in steps:
        gate.pace(buffered)
        assert gate.ahead == ahead, (buffered, gate.ahead, ahead)
        assert gate.limit == (ahead + 1) * b
    unpaced = StalenessGate(b, 4)
    for _ in range(10):
        unpaced.pace(9 * b)
    assert unpaced.ahead == 4


def test_a_waiter_is_admitted_when_pacing_lets_it():
    async def scenario():
        gate = StalenessGate(batch_size=4, max_staleness=2, pace=True)
        for _ in range(4):  # calm asks with a batch to spare: down to 1 ahead, limit (0 + 1 + 1) * 4
            gate.pace(8)
        assert gate.ahead == 1
        await gate.wait_admit(4)
        await gate.wait_admit(4)
        waiter = asyncio.create_task(gate.wait_admit(4))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.pace(0)  # the trainer waited: 2 ahead, the same version admits one batch more
        await asyncio.wait_for(waiter, 30.0)  # a hang guard: it returns at once
        assert gate.admitted == 12

    asyncio.run(scenario())


def test_for_config_paces_only_async_runs_that_ask():
    from async_rl.config import load_config

    assert StalenessGate.for_config(load_config(None, ["mode=async", "rollout.pace=true"])).paced
    assert not StalenessGate.for_config(load_config(None, ["mode=async"])).paced
    assert not StalenessGate.for_config(load_config(None, ["mode=sync", "rollout.pace=true"])).paced
    assert StalenessGate.for_config(load_config(None, ["mode=async", "max_staleness=2"])).ahead == 0  # ramps
    assert StalenessGate.for_config(load_config(None, ["mode=async", "max_staleness=2",
                                                       "rollout.fill_ramp=0"])).ahead == 2


def test_the_fill_ramp_starts_one_batch_deep_deepens_only_while_few_generate_and_goes_full_at_the_first_version():
    b = 8
    gate = StalenessGate(b, 3, fill_ramp=0.25)  # deepen while fewer than 2 of the admitted still generate
    assert (gate.ahead, gate.limit) == (0, b)  # the first batch alone
    assert not gate.ramp(2)  # a quarter of a batch still generating: not yet
    assert gate.ramp(1) and gate.limit == 2 * b
    assert gate.ramp(0) and gate.ramp(0) and gate.ahead == 3
    assert not gate.ramp(0) and gate.ahead == 3  # never past eta
    again = StalenessGate(b, 3, fill_ramp=0.25)
    assert again.ramp(0) and again.ahead == 1
    again.set_version(1)  # the first batch is trained: full depth at once, and the ramp is over
    assert (again.ahead, again.limit) == (3, 5 * b)
    paced = StalenessGate(b, 3, pace=True, fill_ramp=0.25)
    paced.pace(2 * b)  # the trainer took its first batch: pacing starts from the full depth, as unramped
    assert paced.ahead == 3 and not paced.ramp(0)
    # without the ramp (0) or without a bound (sync), the gate is as before
    assert StalenessGate(b, 3).ahead == 3 and not StalenessGate(b, 3).ramp(0)
    assert not StalenessGate(b, 0, fill_ramp=0.25).ramp(0)
    with pytest.raises(ValueError, match="fill_ramp"):
        StalenessGate(b, 3, fill_ramp=-1)


def test_a_waiter_of_a_ramping_gate_is_admitted_when_generations_finish_or_nothing_generates():
    async def scenario():
        generating = [0]
        gate = StalenessGate(batch_size=4, max_staleness=2, fill_ramp=0.5)
        await gate.wait_admit(4, lambda: generating[0])  # the first batch, as the gate starts one deep
        generating[0] = 4
        waiter = asyncio.create_task(gate.wait_admit(4, lambda: generating[0]))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # the first batch is all still generating
        generating[0] = 1
        gate.notify()  # three of them finished: under half a batch still generates
        await asyncio.wait_for(waiter, 30.0)  # a hang guard: it returns at once
        assert (gate.ahead, gate.admitted) == (1, 8)
        # a side that joins a run in progress (its count above a one-deep limit) generates nothing yet:
        # with nothing in flight the ramp opens the gate, rather than waiting for a finish that never comes
        joined = StalenessGate(batch_size=4, max_staleness=2, fill_ramp=0.5)
        joined.join(8)
        await asyncio.wait_for(joined.wait_admit(4, lambda: 0), 1.0)
        assert (joined.ahead, joined.admitted) == (2, 12)

    asyncio.run(scenario())


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 32), eta=st.integers(0, 8), ramp=st.sampled_from([0.0, 0.25, 1.0]),
       events=st.lists(st.one_of(st.sampled_from(["admit", "version"]), st.integers(0, 4)), max_size=200))
def test_a_ramping_gate_never_admits_beyond_the_bound(batch, eta, ramp, events):
    gate = StalenessGate(batch, eta, fill_ramp=ramp)
    for ev in events:
        if ev == "version":
            gate.set_version(gate.version + 1)
        elif ev == "admit":
            if gate.can_admit(1):
                gate.admit(1)
        else:
            gate.ramp(ev)
        assert 0 <= gate.ahead <= eta
        assert gate.admitted <= gate.limit <= (gate.version + eta + 1) * batch
