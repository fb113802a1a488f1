"""Group-relative advantages: normalisation per group, zero-variance groups, Dr.GRPO, broadcasting."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.trainer.advantages import broadcast_to_tokens, group_advantages


def test_each_group_is_normalised_on_its_own():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 7.0])
    ids = ["a", "a", "a", "a", "b", "b"]
    adv = group_advantages(rewards, ids, std_norm=True)
    assert adv.dtype == torch.float32 and adv.shape == (6,)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.allclose(adv[4:], torch.tensor([-1.0, 1.0]), atol=1e-5)


def test_groups_need_not_be_contiguous():
    adv = group_advantages(torch.tensor([1.0, 10.0, 0.0, 20.0]), ["a", "b", "a", "b"], std_norm=False)
    assert torch.allclose(adv, torch.tensor([0.5, -5.0, -0.5, 5.0]))


def test_zero_variance_groups_give_zeros():
    adv = group_advantages([1.0, 1.0, 1.0, 0.0, 1.0, 3.0], ["a", "a", "a", "b", "b", "c"], std_norm=True)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[5] == 0.0  # a group of one
    assert torch.allclose(adv[3:5], torch.tensor([-1.0, 1.0]), atol=1e-5)


def test_std_norm_off_only_centres():
    adv = group_advantages([0.0, 2.0, 4.0, 10.0], ["g"] * 4, std_norm=False)
    assert torch.allclose(adv, torch.tensor([-4.0, -2.0, 0.0, 6.0]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(-100, 100)), min_size=1, max_size=20),
       st.booleans())
def test_each_group_sums_to_zero_and_keeps_the_order_of_rewards(items, std_norm):
    ids = [g for g, _ in items]
    rewards = np.array([r for _, r in items])
    adv = group_advantages(rewards, ids, std_norm=std_norm).numpy()
    for g in set(ids):
        idx = [i for i, x in enumerate(ids) if x == g]
        assert abs(adv[idx].sum()) < 1e-3 * max(1.0, np.abs(rewards[idx]).max())
        for i in idx:
            for j in idx:
                if rewards[i] > rewards[j] + 1e-3:
                    assert adv[i] > adv[j]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages([1.0, 2.0], ["a"], std_norm=True)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], ["a", "a"], std_norm=True)


def test_broadcast_to_trained_tokens_only():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0, 2.0], [0.0, -1.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="advantages"):
        broadcast_to_tokens(torch.tensor([1.0]), mask)


# ---------------------------------------------------------------- estimators: grpo, grpo_turn
from async_rl.config import ModelConfig, TrainerConfig  # noqa: E402
from async_rl.trainer.advantages import ADVANTAGES, get_advantage, grpo, grpo_turn  # noqa: E402
from async_rl.trainer.batching import collate  # noqa: E402
from async_rl.types import Trajectory  # noqa: E402


def _traj(group, reward, mask, *, prompt_len=2, scores=None, ends=None, tid=None):
    mask = np.asarray(mask, np.uint8)
    info = {} if scores is None else {"turn_scores": list(scores), "turn_ends": list(ends)}
    return Trajectory(id=tid or f"{group}-{reward}-{np.random.randint(1 << 30)}", group_id=group,
                      prompt_ids=np.arange(1, prompt_len + 1, dtype=np.int32),
                      response_ids=np.arange(3, 3 + len(mask), dtype=np.int32), loss_mask=mask,
                      behav_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=reward,
                      finish_reason="stop", info=info)


def test_registry_default_is_todays_grpo_and_unknown_names_are_errors():
    assert TrainerConfig().advantage == "grpo" and set(ADVANTAGES) >= {"grpo", "grpo_turn"}
    trajs = [_traj("a", 1.0, [1, 1]), _traj("a", 0.0, [1]), _traj("b", 3.0, [1, 0, 1])]
    expected = group_advantages([1.0, 0.0, 3.0], ["a", "a", "b"], std_norm=True)
    assert torch.equal(get_advantage("grpo")(trajs, TrainerConfig()), expected)
    with pytest.raises(ValueError, match="trainer.advantage.*nope.*grpo_turn"):
        get_advantage("nope")


def test_grpo_turn_without_turn_scores_equals_grpo_on_every_trained_token():
    trajs = [_traj("a", 1.0, [1, 1, 0, 1]), _traj("a", 0.0, [0, 1]), _traj("b", 2.0, [1])]
    cfg = TrainerConfig(advantage="grpo_turn")
    per_token = grpo_turn(trajs, cfg)
    base = grpo(trajs, cfg)
    assert per_token.shape == (3, 3)
    for i, t in enumerate(trajs):
        n = int(t.loss_mask.sum())
        assert torch.allclose(per_token[i, :n], base[i].expand(n))
        assert torch.equal(per_token[i, n:], torch.zeros(3 - n))


def test_turn_scores_credit_their_own_segment_normalised_per_depth():
    # response layout: [assistant 0..2) [user 2..3) [assistant 3..5) [user 5..6) [assistant 6..7)
    mask_a = [1, 1, 0, 1, 1, 0, 1]
    a = _traj("g", 0.5, mask_a, scores=[0.0, 1.0], ends=[2, 5])  # wrong, then right; last turn unscored
    b = _traj("g", 1.0, [1, 1, 0], scores=[1.0], ends=[2])  # right at once
    c = _traj("g", 0.0, [1, 0, 1, 0], scores=[0.0, 0.0], ends=[1, 3])  # wrong twice
    cfg = TrainerConfig(advantage="grpo_turn", adv_std_norm=False, turn_adv_coef=2.0)
    adv = grpo_turn([a, b, c], cfg)
    base = grpo([a, b, c], cfg)  # centred rewards: [0, 0.5, -0.5]
    assert torch.allclose(base, torch.tensor([0.0, 0.5, -0.5]))
    d0 = np.array([0.0, 1.0, 0.0]) - 1 / 3  # depth 0: all three compared
    d1 = np.array([1.0, 0.0]) - 0.5  # depth 1: only a and c reached it
    exp_a = [0.0 + 2 * d0[0]] * 2 + [0.0 + 2 * d1[0]] * 2 + [0.0]  # the unscored last turn: outcome only
    exp_b = [0.5 + 2 * d0[1]] * 2
    exp_c = [-0.5 + 2 * d0[2], -0.5 + 2 * d1[1]]
    assert torch.allclose(adv[0, :5], torch.tensor(exp_a, dtype=torch.float32), atol=1e-5)
    assert torch.allclose(adv[1, :2], torch.tensor(exp_b, dtype=torch.float32), atol=1e-5)
    assert torch.allclose(adv[2, :2], torch.tensor(exp_c, dtype=torch.float32), atol=1e-5)
    assert torch.equal(adv[1, 2:], torch.zeros(3)) and torch.equal(adv[2, 2:], torch.zeros(3))


def test_a_turn_depth_reached_by_one_trajectory_or_with_equal_scores_adds_nothing():
    a = _traj("g", 1.0, [1, 0, 1], scores=[1.0, 1.0], ends=[1, 3])
    b = _traj("g", 0.0, [1, 0], scores=[1.0], ends=[1])
    other = _traj("h", 5.0, [1], scores=[0.0], ends=[1])  # a group of one
    adv = grpo_turn([a, b, other], TrainerConfig(advantage="grpo_turn"))
    base = grpo([a, b, other], TrainerConfig())
    assert torch.allclose(adv[0, :2], base[0].expand(2)) and torch.allclose(adv[1, :1], base[1:2])
    assert torch.equal(adv[2], torch.zeros(2))


def test_per_token_advantages_land_on_the_trained_columns_after_collate():
    a = _traj("g", 1.0, [1, 1, 0, 0, 1], prompt_len=3, scores=[1.0, 0.0], ends=[2, 5])
    b = _traj("g", 0.0, [0, 1, 0, 1], prompt_len=1, scores=[0.0, 1.0], ends=[2, 4])
    trajs = [a, b]
    adv = grpo_turn(trajs, TrainerConfig(advantage="grpo_turn"))  # [2, 3]
    batch = collate(trajs, adv, [1, 0])
    for row, i in enumerate([1, 0]):
        t = trajs[i]
        cols = len(t.prompt_ids) - 1 + np.flatnonzero(t.loss_mask)
        n = len(cols)
        assert torch.allclose(batch.advantages[row, cols], adv[i, :n])
        others = np.setdiff1d(np.arange(batch.advantages.shape[1]), cols)
        assert torch.equal(batch.advantages[row, others], torch.zeros(len(others)))
    assert batch.advantages[1, 2] > batch.advantages[0, 1]  # a's right first turn beats b's wrong one


def test_malformed_turn_info_is_named():
    cfg = TrainerConfig(advantage="grpo_turn")
    with pytest.raises(ValueError, match="turn_scores has 2 entries but info.turn_ends 1"):
        grpo_turn([_traj("g", 0.0, [1, 1], scores=[1.0, 0.0], ends=[2], tid="t1")], cfg)
    with pytest.raises(ValueError, match="t2: info.turn_ends must ascend"):
        grpo_turn([_traj("g", 0.0, [1, 1], scores=[1.0, 0.0], ends=[2, 1], tid="t2")], cfg)
    with pytest.raises(ValueError, match="turn_ends must ascend within"):
        grpo_turn([_traj("g", 0.0, [1, 1], scores=[1.0], ends=[9])], cfg)
    with pytest.raises(ValueError, match="finite"):
        grpo_turn([_traj("g", 0.0, [1, 1], scores=[float("nan")], ends=[1])], cfg)
    with pytest.raises(ValueError, match="a row trains 3 tokens"):
        broadcast_to_tokens(torch.zeros(1, 2), torch.tensor([[1, 1, 1]]))


def test_a_trainer_step_with_grpo_turn_updates_the_model_toward_the_better_turn():
    from async_rl.models import build_tiny_tokenizer, load_model
    from async_rl.trainer.trainer import PPOTrainer

    torch.manual_seed(0)
    tok = build_tiny_tokenizer("0123456789")
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet="0123456789"), seed=0, tokenizer=tok)
    with pytest.raises(ValueError, match="trainer.advantage"):
        PPOTrainer(model, TrainerConfig(advantage="bogus"), temperature=1.0, max_staleness=0, seed=0)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-2, advantage="grpo_turn"),
                         temperature=1.0, max_staleness=0, seed=0)
    prompt, good, bad = [5, 6], 7, 8

    def traj(first, reward, score):  # response: [first turn] [user 9] [second turn = good]
        mask = np.array([1, 0, 1], np.uint8)
        ids = np.array([first, 9, good], np.int32)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([prompt + ids.tolist()])).logits[0].float(), -1)
        behav = np.array([lp[1 + k, ids[k]].item() if mask[k] else 0.0 for k in range(3)], np.float32)
        return Trajectory(id=f"t{first}{reward}", group_id="g", prompt_ids=np.array(prompt, np.int32),
                          response_ids=ids, loss_mask=mask, behav_logprobs=behav,
                          versions=np.where(mask == 1, 0, -1).astype(np.int32), reward=reward,
                          finish_reason="stop", info={"turn_scores": [score], "turn_ends": [1]})

    def p_good():
        with torch.no_grad():
            return torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)[good].item()

    before = p_good()
    # equal outcome rewards: only the turn score says the first turn `good` was better than `bad`
    stats = trainer.train_step([[traj(good, 1.0, 1.0), traj(bad, 1.0, 0.0)]])
    assert stats["train/num_tokens"] == 4.0 and p_good() > before


# Group "a" has rewards 1, 0, 0, 1 (mean 0.5, std 0.5), group "b" 0, 3, 0 (mean 1, std sqrt(2)),
# group "c" a single sample, group "d" 2, 2 (no variance).
HAND = [("a", 1.0), ("a", 0.0), ("a", 0.0), ("a", 1.0), ("b", 0.0), ("b", 3.0), ("b", 0.0), ("c", 5.0),
        ("d", 2.0), ("d", 2.0)]


def test_dr_grpo_centres_without_the_std_even_when_asked_for_it():
    trajs = [_traj(g, r, [1]) for g, r in HAND]
    # a: 1 - 0.5 = 0.5, -0.5, -0.5, 0.5;  b: -1, 3 - 1 = 2, -1;  c and d: no signal -> 0
    expected = [0.5, -0.5, -0.5, 0.5, -1.0, 2.0, -1.0, 0.0, 0.0, 0.0]
    adv = get_advantage("dr_grpo")(trajs, TrainerConfig(adv_std_norm=True))
    assert adv.tolist() == pytest.approx(expected)
    # grpo divides the same values by the std: a by 0.5, b by sqrt(2)
    assert grpo(trajs, TrainerConfig()).tolist()[:6] == pytest.approx([1, -1, -1, 1, -1 / 2**0.5, 2 / 2**0.5], rel=1e-5)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    trajs = [_traj(g, r, [1]) for g, r in HAND]
    # a: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3, -2/3, 2/3
    # b: 0 - (3 + 0) / 2 = -1.5, 3 - 0 = 3, -1.5;  c: nobody else -> 0;  d: 2 - 2 = 0
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.5, 3.0, -1.5, 0.0, 0.0, 0.0]
    assert get_advantage("rloo")(trajs, TrainerConfig()).tolist() == pytest.approx(expected, rel=1e-6)
