"""Core sharing: a process gets its share, plus the shares of processes that wait or are gone."""

import multiprocessing as mp

import torch

from async_rl.utils.cores import CoreShare, refresh_per_layer


def test_idle_neighbour_lends_its_cores(tmp_path):
    path = tmp_path / ".cores"
    trainer = CoreShare(path, slot=0, share=1, total=2)
    engine = CoreShare(path, slot=1, share=1, total=2)
    assert trainer.lent_to_me() == 1 and engine.lent_to_me() == 1  # both busy: the fixed split
    engine.idle()
    assert trainer.lent_to_me() == 2  # the engine waits: the trainer takes its core
    assert engine.lent_to_me() == 1  # an idle process keeps at least its own share
    assert trainer.refresh() == 2 and torch.get_num_threads() == 2
    engine.busy()
    assert trainer.refresh() == 1 and torch.get_num_threads() == 1
    engine.leave()
    assert trainer.lent_to_me() == 2


def _hold_busy_slot(path: str) -> None:
    CoreShare.claim(path, share=1, total=2)  # exits while marked busy, as a killed process would


def test_claim_takes_free_slots_and_ignores_dead_processes(tmp_path):
    path = tmp_path / ".cores"
    a = CoreShare.claim(path, share=1, total=2)
    proc = mp.get_context("spawn").Process(target=_hold_busy_slot, args=(str(path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert a.lent_to_me() == 2  # the dead process's busy slot does not hold its core
    b = CoreShare.claim(path, share=1, total=2)
    assert b.slot != a.slot and b.slot == 1  # the dead process's slot is reused
    a._checked = 0.0  # force the once-a-second liveness check now
    assert a.lent_to_me() == 1  # b is alive and busy


def test_refresh_per_layer_keeps_forward_outputs(tmp_path):
    from async_rl.config import ModelConfig
    from async_rl.models import build_tiny_tokenizer, load_model

    tok = build_tiny_tokenizer("01+=")
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet="01+="), seed=0, tokenizer=tok)
    ids = torch.tensor([tok.encode("1+1=")])
    before = model(ids).logits
    refresh_per_layer(model, CoreShare(tmp_path / ".cores", slot=0, share=1, total=2))
    assert torch.equal(model(ids).logits, before)


def test_refresh_per_layer_takes_cores_freed_during_the_backward(tmp_path):
    """A neighbour that goes idle after the forward is seen in the backward, with the same gradients."""
    from async_rl.config import ModelConfig
    from async_rl.models import build_tiny_tokenizer, load_model

    tok = build_tiny_tokenizer("01+=")
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet="01+="), seed=0, tokenizer=tok)
    ids = torch.tensor([tok.encode("1+1=")])
    model(ids).logits.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    path = tmp_path / ".cores"
    trainer = CoreShare(path, slot=0, share=1, total=2)
    engine = CoreShare(path, slot=1, share=1, total=2)
    refresh_per_layer(model, trainer)
    loss = model(ids).logits.sum()
    assert torch.get_num_threads() == 1  # the forward ran on the trainer's own share
    engine.idle()  # the engine reaches the staleness gate while the trainer is between forward and backward
    loss.backward()
    assert torch.get_num_threads() == 2  # the backward took the freed core
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    engine.leave()
    trainer.leave()
