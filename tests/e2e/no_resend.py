"""Test-only: imported into a run through `agent.modules`, it breaks the rollout side's outbox re-send: a
side that starts again never sends the groups its trainer did not commit (their prompts are generated
again, as if they had never been made). `tests/e2e/test_breakage.py` sees the audit fail with it. Never
part of a real run."""

import async_rl.launch.rollout_proc


def _nothing_to_resend(outbox, ledger, trainer_version):
    return []


async_rl.launch.rollout_proc.resendable = _nothing_to_resend
