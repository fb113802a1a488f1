"""The simulator: closed-form step times, and proof that it runs the real admission and staleness rules.

A profile with constant lengths and no overheads can be worked out by hand: with B trajectories of
L tokens decoded together at `a` seconds per sequence per step, generating a batch takes G = L a B;
training it takes T = c B (P + L) at `c` seconds per token. Sync alternates: every step takes G + T.
Async on separate pools overlaps them: once the pipeline is full a step takes max(G, T).
"""

import pytest

from async_rl.rollout.staleness import StalenessGate
from async_rl.sim import Placement, profile_from_dict, sim_config, simulate

B, N, L, P = 32, 8, 50, 10
A, C = 1e-3, 1e-4  # seconds per sequence per decode step; seconds per trained token


def profile(per_token_s=C, length=L, **engine):
    return profile_from_dict({
        "units": "core", "prompt_len": P, "response": {"kind": "constant", "value": length},
        "engine": {"per_seq_s": A, "max_running": 100_000, "max_tokens_per_step": 1_000_000, **engine},
        "trainer": {"per_token_s": per_token_s},
        "config": {"trainer.batch_size": B, "rollout.group_size": N, "rollout.max_concurrent": 100_000}})


def run(p, mode, eta, steps=12, placement=Placement.pools(1, 1), ramp=0):
    """The closed forms below are those of a pipeline admitted eta + 1 batches deep at once (no fill ramp)."""
    return simulate(p, sim_config(p, [f"mode={mode}", f"max_staleness={eta}", f"total_steps={steps}",
                                      f"rollout.fill_ramp={ramp}"]), placement)


def test_sync_takes_generation_plus_training_every_step():
    g, t = L * A * B, C * B * (P + L)
    result = run(profile(), "sync", 0, steps=7)
    assert result.wall_s == pytest.approx(7 * (g + t), rel=1e-9)
    assert result.staleness_hist == [7 * B, 0]
    assert run(profile(), "async", 0, steps=7).wall_s == pytest.approx(7 * (g + t), rel=1e-9)  # eta 0 = lock step


def test_each_request_costs_its_per_request_time_in_the_step_that_takes_it_in():
    """Sync takes a batch's B requests in its first step: each step then takes G + B r + T."""
    g, t, r = L * A * B, C * B * (P + L), 2e-4
    assert run(profile(per_request_s=r), "sync", 0, steps=5).wall_s == pytest.approx(5 * (g + B * r + t), rel=1e-9)


@pytest.mark.parametrize("per_token_s", [C, 20 * C])  # generation-bound, then training-bound
@pytest.mark.parametrize("eta", [1, 2, 4])
def test_async_on_pools_takes_the_slower_side_per_step(per_token_s, eta):
    """Generation-bound, eta + 1 batches decode together (equal lengths finish together), so steps come
    in bursts of eta + 1 whose period is (eta + 1) G; training-bound, every step takes T."""
    g, t = L * A * B, per_token_s * B * (P + L)
    cycle = 2 * (eta + 1)
    result = run(profile(per_token_s), "async", eta, steps=10 + 2 * cycle)
    ends = [r.end_s for r in result.records]
    assert (ends[-1] - ends[-1 - cycle]) / cycle == pytest.approx(max(g, t), rel=1e-9)
    if t > g:
        assert all(b - a == pytest.approx(t, rel=1e-9) for a, b in zip(ends[-cycle:], ends[-cycle + 1:]))
    assert result.staleness_hist[-1] == 0  # nothing over the bound reaches the trainer


@pytest.mark.parametrize("eta", [1, 4])
def test_the_fill_ramp_generates_the_first_batch_alone(eta):
    """Admitted eta + 1 batches deep at once, the first batch shares every decode step with eta more, so
    the trainer starts after (eta + 1) G; ramped (the default), it starts after G, as sync does. Trained
    to the end, the ramp is ahead by what it saved when training is the slower side."""
    g, t = L * A * B, 20 * C * B * (P + L)
    burst, ramped = run(profile(), "async", eta, ramp=0), run(profile(), "async", eta, ramp=0.25)
    assert burst.records[0].end_s == pytest.approx((eta + 1) * g + C * B * (P + L), rel=1e-9)
    assert ramped.records[0].end_s == pytest.approx(g + C * B * (P + L), rel=1e-9)
    slow_burst, slow_ramped = (run(profile(20 * C), "async", eta, steps=20, ramp=r) for r in (0, 0.25))
    assert slow_ramped.wall_s == pytest.approx(slow_burst.wall_s - eta * g, rel=1e-9)
    assert slow_ramped.wall_s == pytest.approx(g + 20 * t, rel=1e-9)
    for r in (ramped, slow_ramped):
        assert r.staleness_hist[-1] == 0  # the bound holds while it ramps


def test_a_decode_run_cut_by_arrivals_costs_what_single_steps_cost():
    """Context-dependent steps in closed form (one event per stretch) must equal the step-by-step sum."""
    p = profile(per_ctx_token_s=1e-6, step_base_s=1e-3)
    result = run(p, "sync", 0, steps=3)
    per_step = [1e-3 + A * B + 1e-6 * B * (P + k) for k in range(L)]  # k-th token of every sequence
    gen = sum(per_step)
    assert result.records[0].end_s == pytest.approx(gen + C * B * (P + L), rel=1e-9)


def test_a_change_to_the_real_gate_changes_the_simulated_staleness(monkeypatch):
    p = profile(length=L)
    before = run(p, "async", 1, steps=12)
    monkeypatch.setattr(StalenessGate, "limit", property(lambda g: (g.version + 2 * g.max_staleness + 1) * g.batch_size))
    after = run(p, "async", 1, steps=12)
    assert before.staleness_hist[-1] == 0 and before.restarted == 0
    assert after.staleness_hist != before.staleness_hist
    assert after.staleness_hist[-1] > 0  # admitted beyond what the trainer's filter accepts: dropped
    assert after.restarted > 0  # and generations begun too early are restarted by the real rule


def test_a_change_to_the_real_restart_rule_changes_what_is_restarted(monkeypatch):
    p = profile_from_dict({**_dict(profile()), "response": {"kind": "lognormal", "mean": 60, "sigma": 1.2, "max": 2000}})
    before = run(p, "async", 1, steps=10)
    monkeypatch.setattr(StalenessGate, "stale_attempts", lambda self, started, version: [])
    after = run(p, "async", 1, steps=10)
    assert before.restarted > 0 and after.restarted == 0
    assert after.staleness_hist[-1] > before.staleness_hist[-1]  # not restarted: they arrive over-stale


def test_the_real_stale_tokens_rule_keeps_what_drop_would_lose():
    """rollout.restart_stale=false lets long generations arrive over the bound; the trainer's own
    split_by_age then drops them (drop) or trains their tokens within the bound (mask)."""
    p = profile_from_dict({**_dict(profile()), "response": {"kind": "lognormal", "mean": 60, "sigma": 1.2, "max": 2000}})

    def kept(stale_tokens):
        r = simulate(p, sim_config(p, ["mode=async", "max_staleness=1", "total_steps=10", "rollout.restart_stale=false",
                                       f"trainer.stale_tokens={stale_tokens}"]), Placement.pools(1, 1))
        return sum(rec.kept for rec in r.records), sum(rec.dropped for rec in r.records), r.staleness_hist[-1]

    drop, mask = kept("drop"), kept("mask")
    assert drop[1] > 0 and drop[2] > 0  # over-stale arrivals, dropped
    assert mask[1] < drop[1] and mask[0] > drop[0]  # the same kind of arrivals, mostly trained


def test_shared_cores_lend_the_idle_sides_share():
    """Async on 2 shared cores: a side that runs alone gets both cores (speed x (2/1)^1 here)."""
    p = profile_from_dict({**_dict(profile()), "engine": {**_dict(profile())["engine"], "units": 1, "scaling": 1.0},
                           "trainer": {"per_token_s": C, "units": 1, "scaling": 1.0}})
    g, t = L * A * B, C * B * (P + L)
    shared = run(p, "async", 0, steps=5, placement=Placement.shared(2))
    assert shared.wall_s == pytest.approx(5 * (g + t) / 2, rel=1e-9)  # eta 0: never together, each on 2 cores


def _dict(p):
    from async_rl.sim.profile import profile_to_dict

    return profile_to_dict(p)


@pytest.mark.parametrize("bad,match", [
    ({"engine": {"per_seq_s": -1}}, "engine.per_seq_s"),
    ({"engine": {"speed": 1}}, "engine.speed: unknown key"),
    ({"wheels": 3}, "wheels: unknown profile key"),
    ({"response": {"kind": "uniform"}}, "response.kind"),
    ({"trainer": {"per_token_s": "fast"}}, "trainer.per_token_s"),
])
def test_bad_profiles_name_the_key(bad, match):
    data = {**_dict(profile()), **bad}
    with pytest.raises(ValueError, match=match):
        profile_from_dict(data)


def test_overlap_slows_a_side_only_while_the_other_works_on_the_same_cores():
    """Sync never runs the two sides at once: the overlap factors change nothing. Async on CPU pools
    generation-bound: the engine is slowed while the trainer works, so steps take longer, but no
    longer than if every step were slowed; on GPUs (separate devices) the factors do nothing."""
    g, t = L * A * B, C * B * (P + L)
    slow = _dict(profile())
    slow["engine"] = {**slow["engine"], "overlap_pools": 2.0}
    slow["trainer"] = {**slow["trainer"], "overlap_pools": 3.0}
    slow = profile_from_dict(slow)
    assert run(slow, "sync", 0, steps=7).wall_s == pytest.approx(7 * (g + t), rel=1e-9)
    fast, slowed = run(profile(), "async", 2, steps=30), run(slow, "async", 2, steps=30)
    period = lambda r: (r.records[-1].end_s - r.records[-19].end_s) / 18  # noqa: E731 (3 cycles of 2 (eta + 1))
    assert period(fast) == pytest.approx(g, rel=1e-9)
    assert g * 1.01 < period(slowed) <= 2 * g + 3 * t
    on_gpus = [profile_from_dict({**_dict(p), "units": "gpu"}) for p in (profile(), slow)]
    assert run(on_gpus[1], "async", 2, steps=30).wall_s == pytest.approx(run(on_gpus[0], "async", 2, steps=30).wall_s,
                                                                         rel=1e-9)


def test_a_sequence_of_lengths_is_replayed_in_order():
    from async_rl.sim.lengths import LengthDist

    draw = LengthDist(kind="sequence", samples=[5, 1, 9], max=8).sampler(None)
    assert [draw() for _ in range(7)] == [5, 1, 8, 5, 1, 8, 5]  # capped at max, then over again
    p = profile_from_dict({**_dict(profile()), "response": {"kind": "sequence", "samples": [L]}})
    assert run(p, "sync", 0, steps=3).wall_s == pytest.approx(run(profile(), "sync", 0, steps=3).wall_s, rel=1e-12)


def _mean_lag(result) -> float:
    return sum(k * n for k, n in enumerate(result.staleness_hist)) / sum(result.staleness_hist)


def _period(result, steps: int) -> float:
    ends = [r.end_s for r in result.records]
    return (ends[-1] - ends[-1 - steps]) / steps


@pytest.mark.parametrize("per_token_s", [C, 20 * C])  # generation-bound, then training-bound
def test_pacing_trains_fresher_data_at_the_same_speed(per_token_s):
    """rollout.pace under the simulated clock (the real gate's rule): training-bound, unpaced data
    arrives about eta versions old and paced about one, at the same step period; generation-bound
    (every eta + 1 batches finish together, then the trainer waits), pacing changes nothing."""
    eta, steps = 4, 60
    base = sim_config(profile(per_token_s), ["mode=async", f"max_staleness={eta}", f"total_steps={steps}"])
    paced_cfg = sim_config(profile(per_token_s), ["mode=async", f"max_staleness={eta}", f"total_steps={steps}",
                                                  "rollout.pace=true"])
    unpaced, paced = (simulate(profile(per_token_s), c, Placement.pools(1, 1)) for c in (base, paced_cfg))
    assert _period(paced, 20) == pytest.approx(_period(unpaced, 20), rel=1e-6)
    assert paced.wall_s == pytest.approx(unpaced.wall_s, rel=1e-6)
    if per_token_s > C:
        assert _mean_lag(unpaced) > eta - 0.5
        assert _mean_lag(paced) < 1.5
    else:
        assert _mean_lag(paced) == pytest.approx(_mean_lag(unpaced))
