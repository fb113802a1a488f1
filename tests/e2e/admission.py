"""What the staleness bound promises, checked on what the rollout side produced and what reached the
trainer, not on what the trainer kept (`train/staleness_max` is measured after the over-stale ones are
dropped, so a broken gate cannot show there).

With batch size B and bound eta the gate admits at most (g + eta + 1) * B trajectories while it
stands at version g, and every token of a trajectory is sampled at or after the version its gate
stood at when it was admitted. Hence:

- produced: when the rollout side loads version v it has pushed (`rollout/trajectories_pushed`,
  counted as groups leave, not by the gate) only trajectories admitted at a version below v: at
  most (v + eta) * B;
- arrived: every trajectory that reaches the trainer counts in `train/staleness_hist` (lag of its
  oldest token behind the trainer's version, 0..eta, and one bin for anything older). At most
  (v + eta + 1) * B of them can have their oldest token at version v or before; the histogram gives
  a lower bound of that count (the last bin only says "at or before s - eta - 1");
- dropped: what arrived over the bound is what the trainer dropped and counted (`train/dropped_stale`).

`pytest --no-staleness-gate` runs the tests that use these checks with the gate disabled
(`no_staleness_gate.py`, imported into the run through `agent.modules`); they must fail then.
"""

from __future__ import annotations

GATE_OFF = {"on": False}  # set by conftest.py from --no-staleness-gate
GATE_OFF_MODULE = "tests.e2e.no_staleness_gate"


def gate_overrides() -> list[str]:
    """Config overrides that disable the staleness gate when the suite was asked to (else none)."""
    return [f"agent.modules=[{GATE_OFF_MODULE}]"] if GATE_OFF["on"] else []


def check_produced(rollout_rows: list[dict], *, eta: int, batch: int) -> None:
    for r in rollout_rows:
        if "rollout/trajectories_pushed" in r:
            v, pushed = r["step"], r["rollout/trajectories_pushed"]
            assert pushed <= (v + eta) * batch, (
                f"the rollout side had pushed {pushed} trajectories when it loaded v{v}: more than the "
                f"(v + eta) * B = {(v + eta) * batch} the staleness gate admits (eta={eta}, B={batch})")


def check_arrived(train_rows: list[dict], *, eta: int, batch: int) -> None:
    arrivals: list[tuple[int, int]] = []  # (a version the oldest token is at or before, how many)
    dropped = 0
    for r in train_rows:
        hist = r["train/staleness_hist"]
        assert len(hist) == eta + 2, hist
        s = r["policy_version"] - (0 if r["train/skipped_batch"] else 1)  # the trainer's version on arrival
        arrivals += [(max(s - lag, 0), n) for lag, n in enumerate(hist)]  # exact up to eta, then "or before"
        dropped += r["train/dropped_stale"]
        assert hist[-1] == r["train/dropped_stale"], (
            f"step {r['step']}: {hist[-1]} arrived over the bound, {r['train/dropped_stale']} dropped")
    for v in range(max((o for o, _ in arrivals), default=0) + 1):
        n = sum(k for o, k in arrivals if o <= v)
        assert n <= (v + eta + 1) * batch, (
            f"{n} arrivals had their oldest token at version {v} or before: more than the (v + eta + 1) * B = "
            f"{(v + eta + 1) * batch} the staleness gate admits (eta={eta}, B={batch}); dropped as stale: {dropped}")


def check_admission(train_rows: list[dict], rollout_rows: list[dict], *, eta: int, batch: int) -> None:
    """The run produced, delivered and dropped only what the staleness bound allows."""
    check_produced(rollout_rows, eta=eta, batch=batch)
    check_arrived(train_rows, eta=eta, batch=batch)
