"""The per-step learning diagnostics every run logs (trainer/stats.py, kl_probe.py, logprobs.py entropy):
each checked against an independent computation on a tiny random Llama, so a wrong formula fails."""

import copy

import numpy as np
import pytest
import torch

from async_rl.config import TrainerConfig
from async_rl.trainer.kl_probe import KlProbe, k3_mean
from async_rl.trainer.logprobs import token_logprobs
from async_rl.trainer.stats import StatsAccumulator, group_stats
from async_rl.trainer.trainer import PPOTrainer
# fixtures too: tok, and every test on one torch thread
from tests.unit.test_trainer import _good_bad_groups, _ids, _model, _one_thread, _traj, tok  # noqa: F401


def _entropy(model, ids, temperature):
    """[len(ids) - 1] entropy of each next-token distribution, from the full softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_comes_with_the_logprobs_and_changes_nothing_else(tok):
    model = _model(tok)
    seqs = [_ids(tok, s) for s in ("1+2=3", "12+30=42 ")]
    L = max(map(len, seqs))
    ids, attn = torch.zeros(2, L, dtype=torch.long), torch.zeros(2, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], attn[b, :len(s)] = torch.tensor(s), 1
    plain = token_logprobs(model, ids, attn, 0.7, chunk_tokens=3)
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = token_logprobs(model, ids, attn, 0.7, chunk_tokens=3, entropy=True)
    lp.sum().backward()
    assert torch.equal(lp, plain) and not ent.requires_grad
    assert all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in model.named_parameters())
    for b, s in enumerate(seqs):
        assert torch.allclose(ent[b, :len(s) - 1], _entropy(model, s, 0.7), atol=1e-5)
        assert (ent[b, len(s) - 1:] == 0).all()
    none = token_logprobs(model, ids, attn, 0.7, score_mask=torch.zeros(2, L - 1), entropy=True)
    assert none[1].shape == (2, L - 1) and not none[1].any()


def test_the_trainer_logs_the_entropy_of_its_trained_tokens(tok):
    model = _model(tok)
    groups = _good_bad_groups(tok, model, version=0)
    want = []
    for g in groups:
        for t in g:
            ids = list(t.prompt_ids) + list(t.response_ids)
            want += _entropy(model, ids, 1.0)[len(t.prompt_ids) - 1:].tolist()
    stats = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=1,
                       seed=0).train_step(groups)
    assert stats["train/entropy"] == pytest.approx(np.mean(want), abs=1e-5)


def test_gradient_norm_after_clipping_is_what_torch_left():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(5) * 4
    acc = StatsAccumulator()
    before = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    acc.add_grad_norm(before, 1.0)
    after = float(torch.linalg.vector_norm(torch.cat([p.grad for p in params])))
    acc.add_grad_norm(0.5, 1.0)  # under the bound: untouched
    acc.add_grad_norm(3.0, 0.0)  # clipping off
    out = acc.result()
    assert before > 1.0 and after == pytest.approx(1.0, abs=1e-5)
    assert out["train/grad_norm"] == pytest.approx((before + 0.5 + 3.0) / 3)
    assert out["train/grad_norm_clipped"] == pytest.approx((after + 0.5 + 3.0) / 3, abs=1e-5)
    assert out["train/grad_clipped_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("clip", [1e-4, 0.0])
def test_the_trainer_reports_the_norm_before_and_after_clipping(tok, clip):
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", grad_clip=clip), temperature=1.0,
                         max_staleness=1, seed=0)
    stats = trainer.train_step(_good_bad_groups(tok, model, version=0))
    assert stats["train/grad_norm"] > 1e-3
    if clip:
        assert stats["train/grad_norm_clipped"] == pytest.approx(clip, rel=1e-3)
        assert stats["train/grad_clipped_frac"] == 1.0
    else:
        assert stats["train/grad_norm_clipped"] == stats["train/grad_norm"]
        assert stats["train/grad_clipped_frac"] == 0.0


def test_group_stats_count_groups_without_reward_variance(tok):
    model = _model(tok)
    p = _ids(tok, "1+1=")
    rewards = {"a": [1.0, 1.0, 1.0], "b": [0.0, 0.0], "c": [1.0, 0.0, 0.0, 1.0], "d": [0.5]}
    trajs = [_traj(model, p, [5], reward=r, group=g) for g, rs in rewards.items() for r in rs]
    out = group_stats(trajs)
    assert out["train/group_reward_means"] == [1.0, 0.0, 0.5, 0.5]
    assert out["train/zero_var_groups_frac"] == 3 / 4  # a, b, and d (a group of one)
    stats = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=1,
                       seed=0).train_step([[t for t in trajs if t.group_id == g] for g in rewards])
    assert stats["train/zero_var_groups_frac"] == 3 / 4


def test_kl_prev_is_measured_on_the_tokens_the_previous_version_sampled(tok):
    """Behaviour log-probs of version-3 tokens = the model's own minus a known gap: kl_prev is the k3 mean
    of exactly those gaps; version-4 tokens (the trainer's own) and version-2 ones do not count."""
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=2,
                         seed=0, policy_version=4)
    p = _ids(tok, "1+1=")
    trajs = [_traj(model, p, [5, 6], reward=1.0, group="a", version=3),
             _traj(model, p, [7], reward=0.0, group="a", version=4),
             _traj(model, p, [8], reward=1.0, group="b", version=2),
             _traj(model, p, [9], reward=0.0, group="b", version=3)]
    for t, gap in zip(trajs, ([0.4, -0.2], [3.0], [2.0], [0.1])):
        t.behav_logprobs[:] -= np.asarray(gap, np.float32)
    stats = trainer.train_step([trajs[:2], trajs[2:]])
    d = [0.4, -0.2, 0.1]  # log(pi_v / pi_{v-1}) on the version-3 tokens
    assert stats["train/kl_prev"] == pytest.approx(np.mean([np.exp(x) - 1 - x for x in d]), abs=1e-5)
    assert stats["train/kl_prev_frac"] == pytest.approx(3 / 5)


def test_k3_mean_is_the_kl_of_the_sampling_policy():
    """On tokens drawn from p, mean k3(log q - log p) -> KL(p || q), the exact sum over a small vocabulary."""
    gen = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(6, generator=gen), 0), torch.softmax(torch.randn(6, generator=gen), 0)
    draws = torch.multinomial(p, 200_000, replacement=True, generator=gen)[None]  # [1, N]
    est = k3_mean(q.log()[draws], p.log()[draws], torch.ones_like(draws))
    assert est == pytest.approx(float((p * (p / q).log()).sum()), rel=0.02)


def test_the_probe_measures_kl_to_the_starting_weights(tok):
    model = _model(tok)
    start = copy.deepcopy(model)
    cfg = TrainerConfig(compute_dtype="float32", lr=1e-2, kl_probe_seqs=1)
    trainer = PPOTrainer(model, cfg, temperature=1.0, max_staleness=1, seed=0)
    groups = _good_bad_groups(tok, model, version=0)
    groups[0][0].versions[:] = 7  # not sampled by the starting weights: never a probe
    first = trainer.train_step(groups)
    probe = trainer.kl_probe.batch
    assert probe.input_ids.shape[0] == 1  # kl_probe_seqs responses, one per group
    assert probe.input_ids[0].tolist()[-1] == _ids(tok, "7")[0]  # the group's first start-version response
    mask = probe.loss_mask.bool()

    def logprobs(m):
        with torch.no_grad():
            return token_logprobs(m, probe.input_ids, None if trainer.packed else probe.attention_mask, 1.0,
                                  score_mask=probe.loss_mask,
                                  position_ids=probe.position_ids if trainer.packed else None)
    d = (logprobs(model) - logprobs(start))[mask].double()
    assert first["train/kl_init"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-4)
    assert first["train/kl_init"] > 0 and first["timing/kl_probe_s"] >= 0
    for _ in range(2):
        last = trainer.train_step(_good_bad_groups(tok, model, version=trainer.policy_version))
    assert last["train/kl_init"] > first["train/kl_init"]  # three steps the same way drift further
    assert trainer.kl_probe.batch is probe  # captured once
    off = PPOTrainer(_model(tok), TrainerConfig(kl_probe_seqs=0), temperature=1.0, max_staleness=1, seed=0)
    assert "train/kl_init" not in off.train_step(_good_bad_groups(tok, off.model, version=0))
    with pytest.raises(ValueError, match="trainer.kl_probe_seqs"):
        KlProbe(-1)
