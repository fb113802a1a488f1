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
