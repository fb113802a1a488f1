"""Built-in simulated users (arith_user, echo_user), the interaction_debug / tir_arith tasks, and
loading interactions from YAML: unknown type, missing file, bad config -> one clear error."""

import asyncio
import textwrap

import pytest

from async_rl.agent.interactions import INTERACTIONS, load_interactions
from async_rl.agent.interactions.builtin import ArithUser, EchoUser
from async_rl.config import TaskConfig, load_config
from async_rl.models import CHATML_TEMPLATE
from async_rl.tasks import build_task
from async_rl.tasks.interaction_debug import USER_CHARS


def run(coro):
    return asyncio.run(coro)


def said(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


async def _episode(user, kwargs, answers):
    iid = await user.start_interaction("ep-1", **kwargs)
    turns = []
    for text in answers:
        turns.append(await user.generate_response(iid, said(text)))
        if turns[-1].done:
            break
    score = await user.calculate_score(iid)
    await user.finalize_interaction(iid)
    return turns, score


def test_arith_user_right_at_once_scores_one_and_ends():
    turns, score = run(_episode(ArithUser(max_turns=3), {"answer": "391"}, ["17 * 23 = 391"]))
    assert [(t.done, t.score, t.reply) for t in turns] == [(True, 1.0, "")] and score == 1.0


def test_arith_user_retries_then_discounts_and_gives_up_after_max_turns():
    turns, score = run(_episode(ArithUser(max_turns=3, discount=0.5), {"answer": "42"}, ["41", "no idea", "42"]))
    assert [(t.done, t.score) for t in turns] == [(False, 0.0), (False, 0.0), (True, 1.0)]
    assert turns[0].reply == "No, try again." and score == 0.25
    turns, score = run(_episode(ArithUser(max_turns=2), {"answer": "42"}, ["1", "2", "42"]))
    assert len(turns) == 2 and turns[-1].done and turns[-1].reply == "" and score == 0.0


def test_arith_user_hints_say_which_way():
    user = ArithUser(feedback="hint", max_turns=5)
    turns, _ = run(_episode(user, {"answer": 50}, ["60", "it is 40", "hmm", "50"]))
    assert [t.reply for t in turns[:3]] == ["No, that is too high.", "No, that is too low.",
                                           "I see no number. Answer with just the number."]


def test_state_is_per_instance_and_dropped_on_finalize():
    user = EchoUser(max_turns=3)

    async def go():
        a = await user.start_interaction("a", text="3")
        b = await user.start_interaction("b", text="4")
        ra = await user.generate_response(a, said("3"))
        rb = await user.generate_response(b, said("3"))
        scores = (await user.calculate_score(a), await user.calculate_score(b))
        await user.finalize_interaction(a)
        assert set(user._state) == {"b"}
        await user.finalize_interaction(b)
        assert user._state == {}
        with pytest.raises(ValueError, match="unknown instance 'a'"):
            await user.generate_response(a, said("3"))
        return ra, rb, scores

    ra, rb, scores = run(go())
    assert ra.done and ra.score == 1.0 and not rb.done and rb.reply == "no, say 4" and scores == (1.0, 0.0)


def test_echo_user_wants_an_exact_repeat():
    turns, score = run(_episode(EchoUser(), {"text": "3"}, [" 3\n"]))
    assert turns[0].done and score == 1.0
    turns, score = run(_episode(EchoUser(max_turns=2), {"text": "3"}, ["33", "3"]))
    assert [t.score for t in turns] == [0.0, 1.0] and score == 0.5


def test_echo_user_prefix_match_and_format_score():
    turns, score = run(_episode(EchoUser(match="prefix"), {"text": "3"}, ["3 is it"]))
    assert turns[0].done and score == 1.0
    user = EchoUser(max_turns=2, format_score=0.1)
    assert run(_episode(user, {"text": "3"}, ["4", "5"]))[1] == 0.1  # answered, never right
    assert run(_episode(user, {"text": "3"}, []))[1] == 0.0  # never judged (cut at its token limit)
    assert run(_episode(user, {"text": "3"}, ["", " "]))[1] == 0.0  # empty turns are no answer
    assert run(_episode(ArithUser(format_score=0.2, max_turns=1), {"answer": "7"}, ["eight"]))[1] == 0.0
    assert run(_episode(ArithUser(format_score=0.2, max_turns=1), {"answer": "7"}, ["8"]))[1] == 0.2
    assert run(_episode(user, {"text": "3"}, ["4", "3"]))[1] == 0.5


def test_missing_kwargs_and_bad_config_are_named():
    with pytest.raises(ValueError, match="interaction_kwargs needs 'answer'"):
        run(ArithUser(name="tutor").start_interaction("x", question="1+1"))
    with pytest.raises(ValueError, match="answer must be a number"):
        run(ArithUser().start_interaction("x", answer="forty"))
    with pytest.raises(ValueError, match="config.max_turns"):
        EchoUser(max_turns=0)
    with pytest.raises(ValueError, match="config.discount"):
        ArithUser(discount=2)
    with pytest.raises(ValueError, match="config.feedback must be one of retry|hint"):
        ArithUser(feedback="shout")
    with pytest.raises(ValueError, match="config.retry must be a string whose only field is"):
        EchoUser(retry="say {digit}")
    with pytest.raises(ValueError, match="config.match must be one of exact|prefix"):
        EchoUser(match="fuzzy")
    with pytest.raises(ValueError, match="config.format_score must be in"):
        EchoUser(format_score=-1)


# --------------------------------------------------------------------------------- YAML
def _yaml(tmp_path, text):
    p = tmp_path / "interactions.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_the_default_yaml_loads_both_builtins():
    loaded = load_interactions("configs/interactions/default.yaml")
    assert isinstance(loaded["arith_user"], ArithUser) and isinstance(loaded["echo_user"], EchoUser)
    assert loaded["arith_user"].max_turns == 3 and loaded["arith_user"].name == "arith_user"
    assert {"arith_user", "echo_user"} <= set(INTERACTIONS)


def test_yaml_names_map_to_types_and_classes(tmp_path):
    p = _yaml(tmp_path, """\
        interactions:
          - {name: tutor, type: arith_user, config: {max_turns: 1}}
          - {name: parrot, class: "async_rl.agent.interactions.builtin:EchoUser"}
    """)
    loaded = load_interactions(p)
    assert isinstance(loaded["tutor"], ArithUser) and loaded["tutor"].max_turns == 1
    assert isinstance(loaded["parrot"], EchoUser) and loaded["parrot"].name == "parrot"


@pytest.mark.parametrize("body, message", [
    ("interactions:\n  - {name: x, type: nope}\n", "unknown interaction type 'nope'; registered: .*arith_user"),
    ("interactions:\n  - {name: x, class: 'no.such.module:Cls'}\n", "cannot import module 'no.such.module'"),
    ("interactions:\n  - {name: x, class: 'async_rl.config:TaskConfig'}\n", "not a BaseInteraction subclass"),
    ("interactions:\n  - {name: arith_user, config: {max_turn: 3}}\n", r"arith_user\.config: .*max_turn"),
    ("interactions:\n  - {name: arith_user, config: {max_turns: -1}}\n", "config.max_turns must be"),
    ("interactions:\n  - {name: echo_user, config: [1]}\n", r"echo_user\.config: must be a map"),
    ("interactions:\n  - {name: echo_user, colour: red}\n", r"unknown key\(s\) \['colour'\]"),
    ("interactions:\n  - {name: echo_user}\n  - {name: echo_user}\n", "defined twice"),
    ("users: []\n", "top-level `interactions:` list"),
])
def test_bad_yaml_is_one_clear_error(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        load_interactions(_yaml(tmp_path, body))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="agent.interactions_config: file not found: .*nowhere.yaml"):
        load_interactions(tmp_path / "nowhere.yaml")


# --------------------------------------------------------------------------------- tasks
def test_interaction_debug_samples_name_agent_and_interaction_cycled():
    task = build_task(TaskConfig(name="interaction_debug", max_operand=4, agents=["tool_agent", "mine"],
                                 interactions=["echo_user", "arith_user"]))
    it = task.train_samples(0)
    samples = [next(it) for _ in range(4)]
    assert [s.agent for s in samples] == ["tool_agent", "mine"] * 2
    assert [s.info["interaction"] for s in samples] == ["echo_user", "arith_user"] * 2
    for s in samples:
        digit = s.answer
        assert s.messages == [{"role": "user", "content": f"say {digit}"}] and 0 <= int(digit) <= 4
        assert s.info["interaction_kwargs"] == {"text": digit, "answer": digit}
        assert task.reward(s, f"{digit}\n") == 1.0 and task.reward(s, f"{digit}{digit}") == 0.0
    default = next(build_task(TaskConfig(name="interaction_debug")).train_samples(0))
    assert default.agent == "tool_agent" and default.info["interaction"] == "echo_user"
    with pytest.raises(ValueError, match="single digits"):
        build_task(TaskConfig(name="interaction_debug", max_operand=12))


def test_interaction_debug_config_alphabet_covers_what_the_user_and_template_say():
    cfg = load_config("configs/interaction_debug.yaml")
    alphabet = set(cfg.model.tiny_alphabet)
    digits = {str(d) for d in range(cfg.task.min_operand, cfg.task.max_operand + 1)}
    assert "<|im_start|>{{ message['role'] }}\n" in CHATML_TEMPLATE  # role names and newlines are text
    retry = load_interactions(cfg.agent.interactions_config)["echo_user"].retry
    needed = USER_CHARS | set(retry.format(text="0")) | set("user assistant\n") | digits
    assert needed <= alphabet, f"missing from tiny_alphabet: {sorted(needed - alphabet)}"


def test_tir_arith_offers_tools_in_hermes_format_and_scores_the_last_number():
    task = build_task(TaskConfig(name="tir_arith", min_operand=11, max_operand=99, ops=["*"], eval_size=5))
    s = next(task.train_samples(0))
    assert s.agent == "tool_agent"
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    system = s.messages[0]["content"]
    assert '<tool_call>{"name": "python", "arguments": {"code": "print(17*23)"}}</tool_call>' in system
    assert "calculator" in system
    a, b = s.info["a"], s.info["b"]
    assert s.messages[-1]["content"] == f"What is {a} * {b}?" and s.answer == str(a * b)
    assert "<tool_call>" in s.messages[2]["content"] and s.messages[3]["content"] == "391"  # the worked example
    assert 11 <= a <= 99 and 11 <= b <= 99
    assert task.reward(s, f"The answer is {a * b}.") == 1.0 and task.reward(s, f"{a * b} or {a * b + 1}") == 0.0
    assert [x.id for x in task.eval_samples()] == [f"eval-{i}" for i in range(5)]
    assert task.eval_samples()[0].messages == task.eval_samples()[0].messages  # a fixed held-out set
    with pytest.raises(ValueError, match="task.ops"):
        build_task(TaskConfig(name="tir_arith", ops=["^"]))
