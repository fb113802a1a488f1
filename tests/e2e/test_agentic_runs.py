"""Agentic runs from the command line: `async-rl run --config configs/interaction_debug.yaml` trains on
multi-turn episodes with a simulated user (mask 0 on the user's tokens, traces written), and one run
serves samples with different agent loops (the tool agent and a user's own, from `agent.modules`) and
different YAML-configured interactions, each picked per sample."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.admission import check_admission, gate_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "interaction_debug.yaml")
# small and quick: 4 prompts x 4 samples per step, a short held-out set
QUICK = ["total_steps=3", "log.progress=false", "trainer.batch_size=16", "rollout.group_size=4",
         "task.eval_size=8", "log.trajectories=true", "rollout.max_new_tokens=8"]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def zero_spans_inside(mask: list[int]) -> int:
    """How many runs of 0 lie between trained tokens (a user or tool turn inside the response)."""
    text = "".join(map(str, mask)).strip("0")
    return len([s for s in text.split("1") if s])


def test_interaction_debug_run_is_multi_turn_with_traces(tmp_path):
    res = cli("run", "--config", CONFIG, f"run_dir={tmp_path}", "rollout.trace_every=1", "trainer.advantage=grpo_turn",
              *QUICK, *gate_overrides())
    assert res.returncode == 0, res.stderr[-3000:]
    rows = jsonl(tmp_path / "metrics.jsonl")
    check_admission(rows, jsonl(tmp_path / "rollout_metrics.jsonl"), eta=2, batch=16)  # produced, arrived, dropped
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/staleness_max"] <= 2 for r in rows)
    assert any(r["rollout/agent/user_turns"] > 0 for r in rows)  # per-episode agent metrics reach the log
    trajs = jsonl(tmp_path / "trajectories.jsonl")
    assert any(zero_spans_inside(t["loss_mask"]) for t in trajs), "no trajectory had a user turn"
    for t in trajs:  # untrained tokens carry no behaviour log-prob and no version
        for m, lp, v in zip(t["loss_mask"], t["behav_logprobs"], t["versions"]):
            assert (m == 1) == (v >= 0) and (m == 1 or lp == 0.0)
    traces = jsonl(tmp_path / "traces.jsonl")
    assert traces and all(tr["agent"] == "tool_agent" for tr in traces)
    multi = [tr for tr in traces if any(turn["role"] == "user" for turn in tr["turns"])]
    assert multi, "no traced episode had a user turn"
    for tr in multi:
        spans = [turn["mask"] for turn in tr["turns"]]
        assert spans[0][0] == 0 and spans[-1][1] == tr["response_tokens"]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # turns tile the response
        user = [turn for turn in tr["turns"] if turn["role"] == "user"]
        assert all(turn["text"].startswith("no, say ") for turn in user)
        judged = [turn for turn in tr["turns"] if turn["role"] == "assistant" and turn["score"] is not None]
        assert len(judged) >= len(user)


def test_agents_and_interactions_are_picked_per_sample(tmp_path):
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text("interactions:\n"
                            "  - {name: echo_user, type: echo_user}\n"
                            "  - {name: parrot, type: echo_user, config: {retry: 'no {text}', max_turns: 2}}\n")
    res = cli("run", "--config", CONFIG, f"run_dir={tmp_path / 'run'}", "rollout.trace_every=1",
              "agent.modules=[custom_agent_mod]", f"agent.interactions_config={interactions}",
              "task.agents=[tool_agent,tool_agent,custom_echo]", "task.interactions=[echo_user,parrot]", *QUICK)
    assert res.returncode == 0, res.stderr[-3000:]
    traces = jsonl(tmp_path / "run" / "traces.jsonl")
    agents = {tr["agent"] for tr in traces}
    assert agents == {"tool_agent", "custom_echo"}, agents
    for tr in traces:  # sample i names agents[i % 3] and interactions[i % 2]
        i = int(tr["sample_id"].split("-")[1])
        assert tr["agent"] == ("custom_echo" if i % 3 == 2 else "tool_agent")
        for text in [turn["text"] for turn in tr["turns"] if turn["role"] == "user"]:
            parrot = text.startswith("no ") and "say" not in text
            assert parrot if i % 2 else text.startswith("no, say "), (i, text)
    replies = [turn["text"] for tr in traces for turn in tr["turns"] if turn["role"] == "user"]
    assert any(r.startswith("no, say ") for r in replies) and any(r.startswith("no ") and "say" not in r
                                                                  for r in replies)
