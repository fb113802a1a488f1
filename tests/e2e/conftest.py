"""One finished debug run that several modules read (the report, sim calibration): made once per session."""

from pathlib import Path

import pytest

from tests.e2e.clitools import DEBUG, FINISHED_STEPS, cli


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """5 async steps at eta=1, the rollout side and the trainer pinned to one core each (as calibration
    wants pools), short answers: a run with every file and metric a finished run writes."""
    run = tmp_path_factory.mktemp("finished_run")
    res = cli("run", "--config", DEBUG, f"run_dir={run}", f"total_steps={FINISHED_STEPS}", "mode=async",
              "max_staleness=1", "rollout.max_new_tokens=6", "trainer.batch_size=32", "log.progress=false",
              "cores.engine=[0]", "cores.trainer=[1]", "cores.share=false")
    assert res.returncode == 0, res.stderr[-3000:]
    return run
