"""The command line answers bad input with one clear line and exit code 2, never a traceback or a hang.

Input refused before any process starts is checked in this process (`cli_here`, the same `main`);
`test_the_real_entry_point_refuses_each_kind_in_one_line` runs one case of each kind as a user does.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.clitools import DEBUG, ROOT, cli, cli_here


def assert_one_line_error(res: subprocess.CompletedProcess, needle: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    assert needle in errors[0], errors[0]
    assert "Traceback" not in res.stderr, res.stderr  # the whole of it: pytest's diff cuts the trace short


@pytest.mark.parametrize("args,needle", [
    (["run", "--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
    (["run", "--config", DEBUG, "trainer.bogus=1"], "trainer.bogus: unknown key"),
    (["run", "--config", DEBUG, "total_steps=many"], "total_steps"),
    (["run", "--config", DEBUG, "mode=turbo"], "mode: must be one of async|sync"),
    (["train", "--config", DEBUG], "transport.addr"),
])
def test_config_mistakes(args, needle, tmp_path):
    assert_one_line_error(cli_here(*args, f"run_dir={tmp_path}" if "nope" not in args[2] else "x=1"), needle)


@pytest.mark.parametrize("args,needle", [
    (["train", "--config", DEBUG, "transport.addr=tcp://0.0.0.0:5555"], "transport.curve_keys_dir: the trajectory "
                                                                      "queue binds tcp://0.0.0.0:5555"),
    (["run", "--config", DEBUG, "transport.addr=tcp://*:0"], "`async-rl keys --out DIR`"),
    (["serve", "--config", DEBUG, "engine.host=0.0.0.0"], "engine.api_key: the generation server binds 0.0.0.0"),
    (["run", "--config", DEBUG, "engine.host=0.0.0.0"], "engine.api_key=file:DIR/api_key"),
])
def test_an_address_other_machines_reach_needs_a_key_before_any_process_starts(args, needle, tmp_path):
    """Closed by default: the queue without CURVE keys, a generation server without an API key."""
    res = cli_here(*args, f"run_dir={tmp_path}")
    assert_one_line_error(res, needle)
    assert not [p.name for p in (tmp_path / "logs").glob("*") if p.name != "launcher.log"]  # refused in the launcher


AGENTIC = str(ROOT / "configs" / "interaction_debug.yaml")


@pytest.mark.parametrize("command", ["run", "rollout"])
@pytest.mark.parametrize("override,needle", [
    # registered: what this process registered so far (other tests add loops); a fresh process lists the
    # built-in ones only (test_the_real_entry_point_refuses_each_kind_in_one_line)
    ("rollout.agent=nope", "rollout.agent: unknown agent loop 'nope'; registered: "),
    ("task.agents=[tool_agent,nope]", "task.agents: unknown agent loop 'nope'"),
    ("task.interactions=[echo_user,nope]", "task.interactions: unknown interaction 'nope'; configured: arith_user, "
                                           "echo_user (agent.interactions_config=configs/interactions/default.yaml)"),
    ("agent.modules=[no_such_module]", "agent.modules: cannot import 'no_such_module'"),
    ("agent.tools_config=/no/tools.yaml", "agent.tools_config: file not found: /no/tools.yaml"),
    ("agent.interactions_config=''", "task.name=interaction_debug's default: unknown interaction 'echo_user'; "
                                     "configured: none (agent.interactions_config is unset)"),
])
def test_agent_mistakes_stop_before_any_process_starts(command, override, needle, tmp_path):
    res = cli_here(command, "--config", AGENTIC, f"run_dir={tmp_path}", "transport.addr=tcp://127.0.0.1:9", override)
    assert_one_line_error(res, needle)
    assert not (tmp_path / "logs" / "rollout.log").exists()  # refused in the launcher, no rollout process ran


# a wrong model name fails the trainer and the rollout side's server alike: whichever dies first is reported
# (the server first when the machine is busy; seen with two test workers)
@pytest.mark.parametrize("override,needle", [
    ("model.name=nope", "model.name: 'nope' is neither"),
    ("rollout.server_addrs=[notaurl]", "rollout: rollout.server_addrs: generation server address must start with"),
])
def test_a_process_that_fails_while_starting_is_not_restarted(override, needle, tmp_path):
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", override, timeout=90)
    assert_one_line_error(res, needle)
    assert "it failed while starting, so it was not restarted" in res.stderr
    assert not (tmp_path / "restarts.jsonl").exists()


def test_unreachable_generation_server(tmp_path):
    res = cli("rollout", "--config", DEBUG, f"run_dir={tmp_path}", "transport.addr=tcp://127.0.0.1:9",
              "rollout.server_addrs=[http://127.0.0.1:9]", "rollout.connect_timeout_s=2")
    assert_one_line_error(res, "http://127.0.0.1:9")


def test_unreachable_trainer(tmp_path):
    res = cli("rollout", "--config", DEBUG, f"run_dir={tmp_path}", "transport.addr=tcp://127.0.0.1:9",
              "rollout.connect_timeout_s=3")
    assert_one_line_error(res, "tcp://127.0.0.1:9")


@pytest.mark.parametrize("args,needle", [
    (["run", "trainer.device=cpu", "cluster.trainer_gpus=[0]"],
     "cluster.trainer_gpus: lists GPUs, but the trainer side runs on cpu (trainer.device=cpu)"),
    (["run", "engine.backend=sglang", "engine.device=cpu"], "engine.device: engine.backend=sglang runs on CUDA GPUs"),
    (["rollout", "transport.addr=tcp://127.0.0.1:9", "engine.device=cpu", "cluster.rollout_gpus=[0]"],
     "cluster.rollout_gpus: lists GPUs, but the rollout side runs on cpu"),
    (["run", "launcher=ray", "trainer.device=cpu", "ray.num_gpus_per_trainer=1"],
     "ray.num_gpus_per_trainer: trainer.device=cpu, so a trainer would hold a GPU it never uses"),
])
def test_gpu_placement_mistakes_stop_before_any_process_starts(args, needle, tmp_path):
    """async_rl/placement.py refuses what cannot be placed in the launcher (tests/unit/test_placement.py
    covers every rule over faked GPU counts; these hold on any machine, with or without GPUs)."""
    command, *overrides = args
    res = cli_here(command, "--config", DEBUG, f"run_dir={tmp_path}", *overrides)
    assert_one_line_error(res, needle)
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").glob("*.pid"))  # no child ever ran
@pytest.mark.parametrize("command", ["run", "rollout"])
def test_python_tool_without_isolation_is_refused_at_start_up(command, tmp_path):
    """A container without bubblewrap and user namespaces (here: neither program on PATH): the
    python tool under `isolation: auto` is refused in one line before any process starts."""
    no_bwrap_no_unshare = {**os.environ, "PATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", command, "--config", AGENTIC, f"run_dir={tmp_path}",
                          "transport.addr=tcp://127.0.0.1:9", "agent.tools_config=configs/tools/default.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=no_bwrap_no_unshare)
    assert_one_line_error(res, "agent.tools_config=configs/tools/default.yaml: tool 'python': python tool refused: "
                               "no isolation works on this machine (bwrap: `bwrap` is not installed; unshare: "
                               "`unshare` is not installed); install bubblewrap or allow unprivileged user namespaces, "
                               "or set `isolation: audit` in its config")
    assert not (tmp_path / "logs" / "rollout.log").exists()


def test_the_real_entry_point_refuses_each_kind_in_one_line(tmp_path):
    """One case of each kind above through `python -m async_rl.launch.cli`, as a user runs it: what only a child
    process shows (a warning printed at import, a traceback at start-up) fails here."""
    cases = [(["run", "--config", DEBUG, "mode=turbo"], "mode: must be one of async|sync"),
             (["rollout", "--config", AGENTIC, "transport.addr=tcp://127.0.0.1:9", "rollout.agent=nope"],
              "rollout.agent: unknown agent loop 'nope'; registered: single_turn, tool_agent (a loop of your own"),
             (["run", "--config", DEBUG, "trainer.device=cpu", "cluster.trainer_gpus=[0]"],
              "cluster.trainer_gpus: lists GPUs, but the trainer side runs on cpu")]
    for k, (args, needle) in enumerate(cases):
        assert_one_line_error(cli(*args, f"run_dir={tmp_path / str(k)}", timeout=60), needle)
        assert not (tmp_path / str(k) / "logs" / "rollout.log").exists()


def test_a_refused_run_leaves_nothing_holding_its_output():
    """The launcher starts its children's fork server first thing (async_rl/launch/procs.py); a run refused after
    that stops it at once. Left alone, it would hold the command's stdout open until its ~5 s of imports
    were done: a shell pipe, or a test reading the output, would wait for them."""
    _output_released(["rollout", "--config", AGENTIC, "transport.addr=tcp://127.0.0.1:9", "rollout.agent=nope"],
                     code=2, within_s=1.0, wait_s=60)


def test_a_finished_run_leaves_nothing_holding_its_output(tmp_path):
    """A run that ends well stops its children's fork server too. Left to notice its parent gone, the
    server spent ~1.4 s in an interpreter's teardown (torch, transformers) with the command's stdout
    open: every caller reading the output, a shell pipe or a test, waited that long after the last line."""
    _output_released(["run", "--config", DEBUG, f"run_dir={tmp_path}", "total_steps=1", "log.progress=false"],
                     code=0, within_s=0.3, wait_s=240)


def _output_released(args: list[str], code: int, within_s: float, wait_s: float) -> None:
    """Run the command with its stdout on a pipe: it exits with `code`, and `within_s` later nothing
    else holds the pipe open."""
    proc = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.wait(wait_s) == code
        pipe = os.fstat(proc.stdout.fileno()).st_ino
        deadline = time.monotonic() + within_s
        while (holders := _holders(pipe)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not holders, f"processes still holding the output {within_s} s after the command ended: {holders}"
    finally:
        proc.stdout.close()


def _holders(inode: int) -> list[str]:
    """Command lines of the processes other than this one with pipe `inode` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"pipe:[{inode}]" for fd in fds):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            continue
    return found
