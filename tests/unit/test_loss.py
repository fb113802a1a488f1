"""The decoupled PPO loss against hand computations, its clipping, cap and masking, and its gradient."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.trainer.loss import LOSSES, decoupled_ppo_loss, get_loss, get_loss_agg, kl_penalty, logprob_mismatch

EPS, CAP = 0.2, 5.0


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def _loss(logprobs, prox, behav, adv, mask, eps=EPS, cap=CAP):
    return decoupled_ppo_loss(logprobs, prox, behav, adv, mask, eps_clip=eps, behav_weight_cap=cap)


def _reference(lp, prox, behav, adv, mask, eps, cap):
    """The formula of docs/architecture.md written out token by token in plain Python."""
    total, n = 0.0, 0
    for t in range(len(lp)):
        if not mask[t]:
            continue
        r = math.exp(lp[t] - prox[t])
        w = min(math.exp(prox[t] - behav[t]), cap)
        total += -w * min(r * adv[t], min(max(r, 1 - eps), 1 + eps) * adv[t])
        n += 1
    return total / max(n, 1)


def test_matches_hand_computation():
    lp = _t([-1.0, -2.0, -0.5, -3.0])
    prox = _t([-1.1, -1.5, -0.5, -3.0])
    behav = _t([-1.2, -1.5, -0.9, -2.0])
    adv = _t([1.0, -0.5, 2.0, 1.0])
    mask = _t([1, 1, 1, 0])
    loss, stats = _loss(lp, prox, behav, adv, mask)
    # token 0: r = e^0.1 = 1.105 (inside the clip), w = e^0.1;   term = -e^0.1 * e^0.1 * 1
    # token 1: r = e^-0.5 = 0.607, A < 0 -> min(-0.303, -0.4) = -0.4 (clipped); w = 1; term = 0.4
    # token 2: r = 1, w = e^0.4 = 1.492;                          term = -1.492 * 2
    expected = (-math.exp(0.2) + 0.4 - 2 * math.exp(0.4)) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["behav_weight_max"] == pytest.approx(math.exp(0.4), rel=1e-5)
    assert stats["behav_capped_frac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.5) + 1) / 3, rel=1e-5)
    kl = [(math.exp(x) - 1 - x) for x in (0.1, -0.5, 0.0)]
    assert stats["approx_kl"] == pytest.approx(sum(kl) / 3, rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_matches_reference_on_random_inputs(seed):
    g = np.random.default_rng(seed)
    T = 7
    lp, prox, behav = (g.normal(-2.0, 1.0, T) for _ in range(3))
    adv = g.normal(0.0, 1.0, T)
    mask = g.integers(0, 2, T)
    eps, cap = float(g.uniform(0.05, 0.5)), float(g.uniform(1.0, 10.0))
    loss, _ = _loss(*(torch.tensor(x, dtype=torch.float64)[None] for x in (lp, prox, behav, adv, mask)),
                    eps=eps, cap=cap)
    assert float(loss.detach()) == pytest.approx(_reference(lp, prox, behav, adv, mask, eps, cap), rel=1e-9, abs=1e-12)


def _grad(lp_value, adv_value, prox_value=0.0):
    lp = torch.tensor([[lp_value]], requires_grad=True)
    loss, stats = _loss(lp, _t([prox_value]), _t([prox_value]), _t([adv_value]), _t([1.0]))
    loss.backward()
    return float(loss.detach()), float(lp.grad), stats


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_clipping_stops_the_gradient_only_beyond_the_trust_region(adv):
    beyond = math.log(1 + 2 * EPS) if adv > 0 else math.log(1 - 2 * EPS)  # moved too far in A's direction
    loss, grad, stats = _grad(beyond, adv)
    assert grad == 0.0 and stats["clip_frac"] == 1.0
    assert loss == pytest.approx(-(1 + EPS) * adv if adv > 0 else -(1 - EPS) * adv)
    against = math.log(1 - 2 * EPS) if adv > 0 else math.log(1 + 2 * EPS)  # moved against A: never clipped
    loss, grad, stats = _grad(against, adv)
    assert grad != 0.0 and stats["clip_frac"] == 0.0
    assert loss == pytest.approx(-math.exp(against) * adv, rel=1e-6)


def test_behaviour_weight_is_capped_and_detached():
    behav = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.0 + math.log(10.0), -1.0 + math.log(2.0)]], requires_grad=True)
    lp = prox.detach().clone().requires_grad_(True)  # r = 1
    loss, stats = _loss(lp, prox, behav, _t([1.0, 1.0]), _t([1, 1]), cap=5.0)
    assert float(loss.detach()) == pytest.approx(-(5.0 + 2.0) / 2, rel=1e-6)
    assert stats["behav_capped_frac"] == 0.5
    assert stats["behav_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert stats["behav_weight_mean"] == pytest.approx(6.0, rel=1e-5)
    loss.backward()
    assert behav.grad is None and prox.grad is None
    assert torch.allclose(lp.grad, _t([-5.0, -2.0]) / 2)


def test_masked_tokens_contribute_nothing():
    lp = torch.tensor([[-1.1, 50.0, -0.3]], requires_grad=True)
    prox = _t([-1.2, float("inf"), -0.5])
    behav = _t([-1.1, -float("inf"), -0.4])
    adv = _t([1.5, float("nan"), -0.7])
    loss, stats = _loss(lp, prox, behav, adv, _t([1, 0, 1]))
    loss.backward()
    assert torch.isfinite(loss) and lp.grad[0, 1] == 0.0
    assert torch.isfinite(lp.grad).all() and (lp.grad[0, [0, 2]] != 0).all()
    keep = [0, 2]
    sub, sub_stats = _loss(lp.detach()[:, keep], prox[:, keep], behav[:, keep], adv[:, keep], _t([1, 1]))
    assert float(loss.detach()) == pytest.approx(float(sub))
    assert {k: float(v) for k, v in stats.items()} == pytest.approx({k: float(v) for k, v in sub_stats.items()})


def test_on_policy_reduces_to_minus_mean_advantage():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    loss, stats = _loss(lp, lp, lp, adv, mask)
    assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-6)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["behav_weight_mean"] == pytest.approx(1.0)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_gradient_step_raises_logprob_of_positive_advantage_tokens():
    lp = torch.tensor([[-2.0, -2.0, -2.0]], requires_grad=True)
    adv = _t([1.0, -1.0, 0.0])
    loss, _ = _loss(lp, lp.detach(), lp.detach(), adv, _t([1, 1, 1]))
    loss.backward()
    stepped = lp.detach() - 0.1 * lp.grad  # one step of gradient descent on the loss
    assert stepped[0, 0] > lp[0, 0] and stepped[0, 1] < lp[0, 1] and stepped[0, 2] == lp[0, 2]


def test_huge_ratio_stays_finite():
    loss, grad, _ = _grad(500.0, -1.0)
    assert math.isfinite(loss) and math.isfinite(grad)


def test_bad_arguments_and_registry():
    with pytest.raises(ValueError, match="advantages"):
        _loss(_t([0.0, 0.0]), _t([0.0, 0.0]), _t([0.0, 0.0]), _t([1.0]), _t([1, 1]))
    with pytest.raises(ValueError, match="eps_clip"):
        _loss(_t([0.0]), _t([0.0]), _t([0.0]), _t([1.0]), _t([1]), eps=0.0)
    assert get_loss("decoupled_ppo") is decoupled_ppo_loss and "decoupled_ppo" in LOSSES
    with pytest.raises(ValueError, match="available: decoupled_ppo"):
        get_loss("nope")


def test_no_behav_correction_ignores_the_behaviour_policy():
    from async_rl.trainer.loss import get_loss

    torch.manual_seed(0)
    lp = torch.randn(2, 5, requires_grad=True)
    prox = lp.detach() + 0.1 * torch.randn(2, 5)
    adv, mask = torch.randn(2, 5), torch.ones(2, 5)
    kw = {"eps_clip": 0.2, "behav_weight_cap": 5.0}
    off, _ = get_loss("no_behav_correction")(lp, prox, prox - 1.0, adv, mask, **kw)  # far-off behaviour policy
    same, _ = get_loss("decoupled_ppo")(lp, prox, prox, adv, mask, **kw)  # behaviour == proximal
    corrected, _ = get_loss("decoupled_ppo")(lp, prox, prox - 1.0, adv, mask, **kw)
    assert torch.allclose(off, same) and not torch.allclose(off, corrected)
    with pytest.raises(ValueError, match="trainer.loss"):
        get_loss("nope")


# ------------------------------------------------------------------ behaviour-weight rules
# Four tokens, r = 1 (theta == prox, inside the clip range, so each term is -w * A), cap c = 5,
# rho = pi_prox / pi_behav = 10, 2, 0.1, 1 and A = 1, -1, 2, 0.5; token mean over 4 tokens:
#   decoupled_ppo (TIS, w = min(rho, 5)) w = 5, 2, 0.1, 1   -> -(5 - 2 + 0.2 + 0.5) / 4 = -0.925
#   masked_is     (w = rho if rho <= 5)  w = 0, 2, 0.1, 1   -> -(0 - 2 + 0.2 + 0.5) / 4 = +0.325
#   icepop        (w = rho in [0.2, 5])  w = 0, 2, 0,   1   -> -(0 - 2 + 0   + 0.5) / 4 = +0.375
#   no_behav_correction (w = 1)                             -> -(1 - 1 + 2   + 0.5) / 4 = -0.625
RULE_CASES = {"decoupled_ppo": (-0.925, [5.0, 2.0, 0.1, 1.0], 0.0),
              "masked_is": (0.325, [0.0, 2.0, 0.1, 1.0], 0.25),
              "icepop": (0.375, [0.0, 2.0, 0.0, 1.0], 0.5),
              "no_behav_correction": (-0.625, [1.0, 1.0, 1.0, 1.0], 0.0)}


@pytest.mark.parametrize("name", list(RULE_CASES))
def test_behaviour_weight_rules_match_hand_computation(name):
    expected, weights, masked = RULE_CASES[name]
    behav = torch.tensor([[-2.0, -2.0, -2.0, -2.0]], dtype=torch.float64)
    prox = behav + torch.log(torch.tensor([[10.0, 2.0, 0.1, 1.0]], dtype=torch.float64))
    lp = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    loss, stats = get_loss(name)(lp, prox, behav, adv, torch.ones(1, 4), eps_clip=EPS, behav_weight_cap=CAP)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-9)
    loss.backward()
    # d loss / d logprob_t = -w_t * A_t * r_t / 4: a dropped token gets no gradient at all
    assert lp.grad[0].tolist() == pytest.approx([-w * a / 4 for w, a in zip(weights, [1.0, -1.0, 2.0, 0.5])])
    assert stats["behav_masked_frac"] == masked and stats["behav_capped_frac"] == 0.25
    assert stats["behav_weight_max"] == pytest.approx(10.0) and stats["behav_weight_mean"] == pytest.approx(13.1 / 4)


def test_icepop_keeps_both_ends_of_its_band():
    c = 4.0
    behav = torch.zeros(1, 4, dtype=torch.float64)
    prox = torch.tensor([[math.log(c), -math.log(c), math.log(c) + 1e-9, -math.log(c) - 1e-9]], dtype=torch.float64)
    _, stats = get_loss("icepop")(prox.clone(), prox, behav, torch.ones(1, 4), torch.ones(1, 4), eps_clip=EPS,
                                  behav_weight_cap=c)
    assert stats["behav_masked_frac"] == 0.5  # rho = c and 1/c kept, just beyond either end dropped
    with pytest.raises(ValueError, match="behav_weight_cap"):
        get_loss("icepop")(prox, prox, behav, torch.ones(1, 4), torch.ones(1, 4), eps_clip=EPS, behav_weight_cap=0.5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_masking_rules_equal_truncation_while_no_weight_leaves_the_band(seed):
    g = np.random.default_rng(seed)
    lp, prox = (torch.tensor(g.normal(-2.0, 1.0, (2, 6))) for _ in range(2))
    behav = prox - torch.tensor(g.uniform(-math.log(CAP) + 1e-6, math.log(CAP) - 1e-6, (2, 6)))  # rho in (1/c, c)
    adv, mask = torch.tensor(g.normal(0.0, 1.0, (2, 6))), torch.tensor(g.integers(0, 2, (2, 6)))
    kw = {"eps_clip": EPS, "behav_weight_cap": CAP}
    tis, _ = get_loss("decoupled_ppo")(lp, prox, behav, adv, mask, **kw)
    for name in ("masked_is", "icepop"):
        other, stats = get_loss(name)(lp, prox, behav, adv, mask, **kw)
        assert float(other) == pytest.approx(float(tis), rel=1e-12, abs=1e-12) and stats["behav_masked_frac"] == 0.0


# ------------------------------------------------------------------ aggregation
# A minibatch of two sequences, in two micro-batches: sequence 1 trains 3 tokens with A = 1, sequence
# 2 one token with A = -2; r = 1 and w = 1, so each token's term is -A:
#   token_mean               -(1 + 1 + 1 - 2) / 4 tokens                  = -0.25
#   seq_mean_token_mean      -((1 + 1 + 1) / 3 + (-2) / 1) / 2 sequences  = +0.5
#   seq_mean_token_sum_norm  -((1 + 1 + 1) + (-2)) / (L = 4 * 2 sequences) = -0.125
@pytest.mark.parametrize("name,expected", [("token_mean", -0.25), ("seq_mean_token_mean", 0.5),
                                           ("seq_mean_token_sum_norm", -0.125)])
def test_aggregations_match_hand_computation_across_micro_batches(name, expected):
    agg = get_loss_agg(name)
    micro = [(_t([1, 1, 1]), _t([1.0, 1.0, 1.0])), (_t([1, 0, 0]), _t([-2.0, 0.0, 0.0]))]
    total = 0.0
    for mask, adv in micro:
        weights = agg(mask, tokens=4, seqs=2, norm_tokens=4)
        lp = torch.full_like(mask, -1.0)
        loss, _ = decoupled_ppo_loss(lp, lp, lp, adv, mask, eps_clip=EPS, behav_weight_cap=CAP, loss_weights=weights)
        total += float(loss)
    assert total == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="trainer.loss_agg"):
        get_loss_agg("nope")


def test_dr_grpo_aggregation_needs_its_constant():
    with pytest.raises(ValueError, match="trainer.loss_agg_tokens"):
        get_loss_agg("seq_mean_token_sum_norm")(_t([1, 1]), tokens=2, seqs=1, norm_tokens=0)


# ------------------------------------------------------------------ engine/trainer mismatch
def test_logprob_mismatch_over_the_tokens_of_the_trainers_version():
    prox = _t([-1.0, -2.0, -0.5, -3.0, -1.0])
    # the engine said: 0.1 higher, 0.3 lower, 0.2 higher; a version-2 token 5 off (staleness, not
    # mismatch) and an untrained token 9 off are left out
    behav = _t([-0.9, -2.3, -0.3, 2.0, 8.0])
    versions = torch.tensor([[3, 3, 3, 2, 3]])
    stats, n = logprob_mismatch(prox, behav, versions, _t([1, 1, 1, 1, 0]), version=3)
    d = [-0.1, 0.3, -0.2]  # prox - behav of the three measured tokens
    assert n == 3
    assert stats["logprob_mismatch_mean"] == pytest.approx(0.2, rel=1e-5)
    assert stats["logprob_mismatch_max"] == pytest.approx(0.3, rel=1e-5)
    assert stats["logprob_mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3, rel=1e-4)
    stats, n = logprob_mismatch(prox, behav, versions, _t([1, 1, 1, 1, 0]), version=4)
    assert n == 0 and stats["logprob_mismatch_max"] == 0.0


# ------------------------------------------------------------------ KL to a reference policy
def test_kl_penalty_matches_hand_computation():
    lp = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    ref = _t([-1.5, -1.0, 9.0])
    loss, stats = kl_penalty(lp, ref, _t([1, 1, 0]))
    # d = ref - theta = -0.5, 1.0 (the third token is not trained); k3 = e^d - d - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2]  # 0.1065, 0.7183
    assert float(loss.detach()) == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert stats["ref_kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    loss.backward()
    # d k3 / d theta = 1 - e^d: a token theta rates above the reference is pushed down, one below pushed up
    assert lp.grad[0].tolist() == pytest.approx([(1 - math.exp(-0.5)) / 2, (1 - math.exp(1.0)) / 2, 0.0], rel=1e-6)
    weighted, _ = kl_penalty(lp.detach(), ref, _t([1, 1, 0]), loss_weights=_t([0.25, 0.5, 0.25]))
    assert float(weighted) == pytest.approx(0.25 * k3[0] + 0.5 * k3[1], rel=1e-6)
