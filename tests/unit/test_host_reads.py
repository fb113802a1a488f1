"""Host reads (device syncs on a GPU) left in a micro-batch of the trainer, counted on the CPU
(async_rl/utils/host_reads.py): stats stay on the device until the step ends."""

import numpy as np
import pytest
import torch

from async_rl.config import TrainerConfig
from async_rl.trainer.trainer import PPOTrainer
from async_rl.utils.host_reads import HostReads
from tests.unit.test_trainer import _one_thread, tok  # noqa: F401  (fixtures: pytest finds them here)
from tests.unit.test_trainer import _ids, _model, _traj


def _groups(tok, model):
    return [[_traj(model, _ids(tok, p), _ids(tok, a), reward=float(k % 2), group=p) for k, a in enumerate(answers)]
            for p, answers in (("1+2=", ("3", "3 1+1=2", "12 ")), ("13+20=", ("33", "7", "33 0+0=0")))]


def _reads_per_micro_batch(tok, **cfg) -> list:
    torch.manual_seed(0)
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", micro_batch_tokens=12, **cfg),
                         temperature=1.0, max_staleness=0, seed=0)
    per_micro, accumulate = [], trainer._accumulate

    def counted(*args):
        with HostReads() as reads:
            accumulate(*args)
        per_micro.append(reads.counts)
    trainer._accumulate = counted
    trainer.train_step(_groups(tok, model))
    return per_micro


@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_reads_the_device_at_most_twice(tok, packed):
    """What is left per micro-batch: the nonzero of the scored positions, and transformers' own mask check
    (padded rows) or the sequence lengths the packed attention splits at (packed rows), both before the
    decoder runs (it was 21 reads, stats read one by one)."""
    per_micro = _reads_per_micro_batch(tok, pack_sequences=packed)
    assert len(per_micro) >= 3
    assert all(sum(c.values()) <= 2 and c["nonzero"] == 1 for c in per_micro), per_micro


def test_the_counter_sees_each_kind_of_read():
    """The control: the reads the step no longer makes are counted when they happen."""
    with HostReads() as reads:
        t = torch.ones(3)
        float(t.sum()), t[t > 0], bool(t.any()), np.asarray(t.tolist()), t.sum().item()
    assert reads.counts == {"__float__": 1, "bool_index": 1, "__bool__": 1, "tolist": 1, "item": 1}
