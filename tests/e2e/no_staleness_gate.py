"""Test-only: imported into a run through `agent.modules` (`tests/e2e/test_breakage.py` in every `make test`;
`pytest --no-staleness-gate` for the runs of the other staleness checks), it loosens the rollout side's
staleness gate by 8 versions, so the end-to-end staleness checks (`admission.py`) can be seen to fail with a
gate that does not hold the bound. (Removing the limit altogether makes no run at
all: the admission loop never suspends and spawns groups until the process starves.) Never part of a
real run."""

from async_rl.rollout.staleness import StalenessGate

StalenessGate.limit = property(lambda self: (self.version + self.max_staleness + 1 + 8) * self.batch_size)
