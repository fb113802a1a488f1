"""run_dir/best: the version with the best validation accuracy, with its own weights, whatever order the
evaluations report in (async_rl/trainer/best_checkpoint.py)."""

from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from async_rl.config import load_config
from async_rl.rollout.periodic_eval import record_eval
from async_rl.trainer.best_checkpoint import MAX_PENDING, BestKeeper, read_best


@dataclass
class Trainer:
    """What the keeper reads of a trainer: its version, its weights (each version's value is the version)."""

    policy_version: int = 0
    hf_export = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {"w": torch.full((3,), float(self.policy_version))}


def _cfg(tmp_path, *extra):
    return load_config(None, [f"run_dir={tmp_path}", "total_steps=10", "rollout.eval_every=2", *extra])


def _row(tmp_path, version, val, test, when="periodic", **extra):
    record_eval(tmp_path, {"when": when, "step": version, "policy_version": version, "eval/accuracy": test,
                           "eval/val_accuracy": val, "eval/version_max": version, **extra})


def _kept(tmp_path) -> float:
    return float(load_file(str(tmp_path / "best" / "model.safetensors"))["w"][0])


def test_the_best_validation_version_is_kept_with_its_own_weights(tmp_path):
    trainer, keeper = Trainer(), BestKeeper(_cfg(tmp_path))
    scores = {2: (0.5, 0.9), 4: (0.7, 0.6), 6: (0.7, 0.8), 8: (0.6, 0.95)}  # version: (validation, test)
    for v in range(1, 10):
        trainer.policy_version = v
        keeper.after_publish(trainer)  # v's evaluation reports one version later
        if v - 1 in scores:
            _row(tmp_path, v - 1, *scores[v - 1])
    trainer.policy_version = 10
    keeper.after_publish(trainer)  # the last version is not copied: it is the trainer's own at the end
    assert 10 not in keeper.pending
    _row(tmp_path, 10, 0.65, 0.7, when="after")
    keeper.finish(trainer)
    best = read_best(tmp_path)
    # v4 beat v2 on validation and v6 only tied it; v8's test accuracy (the highest) is never looked at
    assert best["policy_version"] == 4 and best["chosen_on"] == "validation" and best["test_accuracy"] == 0.6
    assert _kept(tmp_path) == 4.0 and not keeper.pending


def test_the_final_version_competes_and_nothing_waits_longer_than_it_must(tmp_path):
    trainer, keeper = Trainer(), BestKeeper(_cfg(tmp_path))
    for v in (2, 4, 6):
        trainer.policy_version = v
        keeper.after_publish(trainer)
    assert sorted(keeper.pending) == [4, 6] and len(keeper.pending) == MAX_PENDING  # evaluations that lag are bounded
    copies = [t.data_ptr() for d in keeper.pending.values() for t in d.values()]
    _row(tmp_path, 6, 0.3, 0.3)
    trainer.policy_version = 7
    keeper.after_publish(trainer)
    assert not keeper.pending  # v4's evaluation was skipped (v6 reported): its copy is dropped
    assert _kept(tmp_path) == 6.0
    trainer.policy_version = 8
    keeper.after_publish(trainer)  # into a copy the keeper had made before (no fresh allocation)
    assert [t.data_ptr() for t in keeper.pending[8].values()][0] in copies
    assert keeper.pending[8]["w"].tolist() == [8.0] * 3
    trainer.policy_version = 10
    _row(tmp_path, 10, 0.9, 0.8, when="after")
    keeper.finish(trainer)
    assert read_best(tmp_path)["policy_version"] == 10 and _kept(tmp_path) == 10.0


def test_without_a_validation_set_the_choice_says_it_was_made_on_the_test_set(tmp_path):
    trainer, keeper = Trainer(2), BestKeeper(_cfg(tmp_path))
    keeper.after_publish(trainer)
    record_eval(tmp_path, {"when": "periodic", "step": 2, "policy_version": 2, "eval/accuracy": 0.4})
    trainer.policy_version = 3
    keeper.after_publish(trainer)
    assert read_best(tmp_path)["chosen_on"] == "test"


@pytest.mark.parametrize("resume", [False, True])
def test_a_resumed_run_keeps_its_best_and_keep_best_false_keeps_nothing(tmp_path, resume):
    trainer = Trainer(2)
    first = BestKeeper(_cfg(tmp_path))
    first.after_publish(trainer)
    _row(tmp_path, 2, 0.8, 0.8)
    trainer.policy_version = 3
    first.after_publish(trainer)
    again = BestKeeper(_cfg(tmp_path, f"trainer.resume={str(resume).lower()}"))
    trainer.policy_version = 4
    again.after_publish(trainer)
    _row(tmp_path, 4, 0.7, 0.9)
    trainer.policy_version = 5
    again.after_publish(trainer)
    assert read_best(tmp_path)["policy_version"] == (2 if resume else 4)
    (tmp_path / "off").mkdir()
    off = BestKeeper(_cfg(tmp_path / "off", "trainer.keep_best=false"))
    trainer.policy_version = 6
    off.after_publish(trainer)
    _row(tmp_path / "off", 6, 1.0, 1.0, when="after")
    off.finish(trainer)
    assert not off.pending and read_best(tmp_path / "off") is None
