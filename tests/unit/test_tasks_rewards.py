"""Arithmetic task and its exact-answer reward; every task's held-out set is never trained on."""

import itertools
from pathlib import Path

import pytest

from async_rl.config import ConfigError, TaskConfig, load_config
from async_rl.rewards.math import exact_number_reward, last_number
from async_rl.tasks import build_task
from async_rl.tasks.generated import HELD_OUT_SHARE, WITH_VALIDATION_SHARE, prompt_key

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("text,expected", [
    ("23 + 45 = 78", "78"), ("The answer is 1,024.", "1024"), ("no digits", None), ("-3", "-3"), ("7", "7"),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_reward_uses_last_number():
    assert exact_number_reward("23 + 45 = 68", "68") == 1.0
    assert exact_number_reward("23 + 45 = 69", "68") == 0.0
    assert exact_number_reward("", "1") == 0.0


def test_task_samples_are_deterministic_and_correct():
    task = build_task(TaskConfig(min_operand=0, max_operand=9, prompt_format="raw"))
    a = [s for s, _ in zip(task.train_samples(1), range(20))]
    b = [s for s, _ in zip(task.train_samples(1), range(20))]
    assert [s.prompt for s in a] == [s.prompt for s in b]
    for s in a:
        x, y = s.prompt.rstrip("=").split("+")
        assert int(s.answer) == int(x) + int(y)
        assert task.reward(s, s.answer) == 1.0
    held_out = task.eval_samples()
    assert held_out == task.eval_samples() and len(held_out) == 100 // HELD_OUT_SHARE  # a third of the 100 sums


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_held_out_problems_are_never_trained_on(path):
    """For every shipped config: the evaluation problems are distinct, and no training stream (the run's
    seed or another, from its start or from where a resumed run picks it up) ever shows one of them,
    while it does show every other problem of a small space."""
    cfg = load_config(path)
    task = build_task(cfg.task)
    held = [prompt_key(s) for s in task.eval_samples()]
    expected = min(cfg.task.eval_size, task.problem_count() // HELD_OUT_SHARE)
    assert len(set(held)) == len(held) == expected > 0
    if path.stem == "smollm2_arith":
        assert len(held) == 128  # `make demo` scores 128 problems (twice as many as before), none trained on
    held += [prompt_key(s) for s in task.val_samples()]  # validation problems are held out too
    for seed in (cfg.seed, cfg.seed + 1):
        trained = {prompt_key(s) for s in itertools.islice(task.train_samples(seed), 3000)}
        assert not trained & set(held), f"{path.name}: trained on held-out problems {sorted(trained & set(held))[:3]}"
        if task.problem_count() <= 1000:  # the rest of a small space is all trained on
            assert len(trained) == task.problem_count() - len(held)


@pytest.mark.parametrize("name,top,test_size", [("arith", 19, 128), ("tir_arith", 19, 128), ("interaction_debug", 9, 3)])
def test_a_validation_set_shares_nothing_with_the_test_set_or_training(name, top, test_size):
    """Validation problems chose what the test set scores: none of them is a test problem or ever trained
    on, and adding them leaves the test set exactly as it was (the numbers measured on it stay comparable)."""
    keys = [f"task.name={name}", f"task.max_operand={top}", f"task.eval_size={test_size}"]
    base, cfg = load_config(None, keys).task, load_config(None, [*keys, "task.val_size=64"]).task
    without, task = build_task(base), build_task(cfg)
    test, val = [prompt_key(s) for s in task.eval_samples()], [prompt_key(s) for s in task.val_samples()]
    assert test == [prompt_key(s) for s in without.eval_samples()] and without.val_samples() == []
    limit = task.problem_count() // WITH_VALIDATION_SHARE - len(test)
    assert len(set(val)) == len(val) == min(64, limit) > 0 and not set(val) & set(test)
    trained = {prompt_key(s) for s in itertools.islice(task.train_samples(3), 3000)}
    assert not trained & (set(val) | set(test))
    small = build_task(load_config(None, ["task.max_operand=2", "task.eval_size=3", "task.val_size=5"]).task)
    assert len(small.eval_samples()) == 3 and len(small.val_samples()) == 9 // WITH_VALIDATION_SHARE - 3
    with pytest.raises(ConfigError, match="task.val_size"):
        load_config(None, ["task.val_size=-1"])


def test_chat_format_and_bad_task():
    task = build_task(TaskConfig(prompt_format="chat"))
    s = task.eval_samples()[0]
    assert s.messages[0]["role"] == "user" and "Answer with just the number" in s.messages[0]["content"]
    with pytest.raises(ValueError, match="task.name"):
        build_task(TaskConfig(name="chess"))
    with pytest.raises(ValueError, match="task.ops"):
        build_task(TaskConfig(ops=["^"]))


def test_first_number_pick():
    assert exact_number_reward("5+3=", "5", pick="first") == 1.0
    assert exact_number_reward("5+3=", "5", pick="last") == 0.0
    task = build_task(TaskConfig(answer_pick="first"))
    s = task.eval_samples()[0]
    assert task.reward(s, s.answer + "+9") == 1.0


@pytest.mark.parametrize("name", ["arith", "tir_arith", "interaction_debug"])
def test_every_task_names_agents_and_interactions_cycled_per_prompt(name):
    lo, hi = (0, 9) if name == "interaction_debug" else (11, 99)
    plain = build_task(TaskConfig(name=name, min_operand=lo, max_operand=hi))
    named = build_task(TaskConfig(name=name, min_operand=lo, max_operand=hi, agents=["a", "b", "c"],
                                  interactions=["arith_user", "echo_user"]))
    base = [s for s, _ in zip(plain.train_samples(3), range(6))]
    samples = [s for s, _ in zip(named.train_samples(3), range(6))]
    assert [s.agent for s in samples] == ["a", "b", "c", "a", "b", "c"]
    assert [s.info["interaction"] for s in samples] == ["arith_user", "echo_user"] * 3
    for s, b in zip(samples, base):  # naming changes nothing else: the same problems from the same seed
        assert (s.prompt, s.messages, s.answer) == (b.prompt, b.messages, b.answer)
        assert s.info["interaction_kwargs"]["answer"] == s.answer
    assert named.names_used() == {"agents": {"task.agents": ["a", "b", "c"]},
                                  "interactions": {"task.interactions": ["arith_user", "echo_user"]}}


def test_names_used_falls_back_to_the_task_defaults():
    assert build_task(TaskConfig(name="arith")).names_used() == {"agents": {}, "interactions": {}}
    assert build_task(TaskConfig(name="interaction_debug", min_operand=0, max_operand=9)).names_used() == \
        {"agents": {"task.name=interaction_debug's default": ["tool_agent"]},
         "interactions": {"task.name=interaction_debug's default": ["echo_user"]}}
    sample = next(build_task(TaskConfig(name="arith")).train_samples(0))
    assert sample.agent is None and "interaction" not in sample.info  # rollout.agent, no simulated user
