"""A generation server that takes longer to answer /health than `rollout.connect_timeout_s` does not cost the
run its first step, with `engine.backend=sglang` (issue 40; tests/e2e/test_vllm_run.py shows it on a real vLLM).

SGLang needs a CUDA GPU, so `engine.python` is a one-line script in front of `sglang_double.py`: the real
sglang launcher starts it with SGLang's command line, it waits DELAY_S (more than the trainer's wait for a
first producer) and then serves this project's engine, which speaks SGLang's API. The trainer is
`async-rl train`; the rollout side is what `async-rl rollout` runs (the body of its process, `child_entry` ->
`rollout_main`), started once the trainer waits for it. Only its server's slot is given here: a CPU slot, as
a launcher passes the slot placement chose (placement refuses sglang without a GPU, rightly; nothing else is
replaced). It used to fail: the rollout side connected to the trainer only once its servers answered,
so the trainer gave up after connect_timeout_s; now it connects first and heartbeats while they start.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from async_rl.config import load_config
from async_rl.launch.common import free_port
from async_rl.models import checkpoint_dir
from tests.e2e.clitools import DEBUG, ROOT
from tests.e2e.test_run import metrics

CONNECT_S = 5.0  # rollout.connect_timeout_s; transport.peer_timeout_s is as short, so the trainer waits this long
DELAY_S = 10.0  # the server's start: more than the trainer's wait, and than the rollout side takes to connect
STEPS = 2

# what `async-rl rollout` does (async_rl/launch/cli.py `_dispatch`), but its servers' placement, with the rollout
# process's own body (`child_entry`) run here rather than in a forked child: its imports and the tokenizer's
# load are done before the trainer is up (argv[1] appears), so the trainer's wait for it starts no earlier
ROLLOUT_SIDE = """
import os, sys, time
from pathlib import Path
from async_rl.config import load_config
from async_rl.launch import procs, rollout_proc  # imported now, not after the trainer is up
from async_rl.launch.common import check_agents, pin_dtypes
from async_rl.models import load_tokenizer
from async_rl.placement import GpuSlot
cfg = load_config(sys.argv[2], sys.argv[3:])
procs.prestart()
check_agents(cfg, prepare=True)
cfg, _ = pin_dtypes(cfg, "rollout")
load_tokenizer(cfg.model)
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
procs.child_entry("rollout", "async_rl.launch.rollout_proc:rollout_main", cfg,
                  {"servers": [GpuSlot(visible=None, device="cpu").to_wire()]}, dict(os.environ), os.getppid())
"""


def _engine_python(tmp_path: Path, marker: Path) -> Path:
    script = tmp_path / "sglang-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests/e2e/sglang_double.py"}" '
                      f'"{marker}" {DELAY_S} "{DEBUG}" "$@"\n')
    script.chmod(0o755)
    return script


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_server_slower_than_connect_timeout_still_trains_the_first_step(tmp_path):
    model = checkpoint_dir(load_config(DEBUG).model, 0, tmp_path / "model")  # SGLang loads checkpoints, not "tiny"
    marker = tmp_path / "double" / "started.jsonl"
    marker.parent.mkdir()
    common = ["--config", DEBUG, f"transport.addr=tcp://127.0.0.1:{free_port()}", f"model.name={model}",
              "model.dtype=float32", "engine.backend=sglang", f"engine.python={_engine_python(tmp_path, marker)}",
              f"rollout.connect_timeout_s={CONNECT_S}", f"transport.peer_timeout_s={CONNECT_S}",
              "transport.heartbeat_s=0.5", f"total_steps={STEPS}", "trainer.batch_size=16", "log.progress=false"]
    train_dir, roll_dir = tmp_path / "t", tmp_path / "r"
    up = train_dir / "logs" / "trainer.up"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = {side: (tmp_path / f"{side}.out").open("w") for side in ("train", "rollout")}
    roll = subprocess.Popen([sys.executable, "-c", ROLLOUT_SIDE, str(up), *common[1:], f"run_dir={roll_dir}"],
                            cwd=ROOT, env=env, stdout=outs["rollout"], stderr=subprocess.STDOUT)
    train = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "train", *common, f"run_dir={train_dir}"],
                             cwd=ROOT, env=env, stdout=outs["train"], stderr=subprocess.STDOUT)
    try:
        train.wait(600)  # a liveness bound only: the run takes well under a minute
        roll.wait(600)
    finally:
        _stop(train)
        _stop(roll)
        for out in outs.values():
            out.close()
    said = "".join(f"--- {side}:\n{(tmp_path / f'{side}.out').read_text()[-3000:]}" for side in outs)
    assert train.returncode == 0 and roll.returncode == 0, said
    assert [r["policy_version"] for r in metrics(train_dir)] == list(range(1, STEPS + 1))
    started = [json.loads(line) for line in marker.read_text().splitlines()]
    assert len(started) == 1 and started[0]["argv"][:2] == ["-m", "sglang.launch_server"]  # the sglang launch path
    # the server began to serve (and so to answer /health) more than connect_timeout_s after the trainer began
    # to wait for a first producer: without the rollout side connecting first, the trainer would have given up
    assert started[0]["serving_from"] - up.stat().st_mtime > CONNECT_S
