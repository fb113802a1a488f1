"""The launchers hand each process the GPUs placement gave it (faked counts: no GPU needed).

What a child is started with (config, CUDA_VISIBLE_DEVICES, arguments) is computed from
`async_rl.placement.place`; `spawn` sets that environment in the child before it runs.
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from async_rl.config import Config, load_config
from async_rl.placement import GpuSlot, for_process, place, ray_slot
from async_rl.launch import servers
from async_rl.launch.local import child_launches
from async_rl.launch.procs import spawn
from async_rl.launch.rollout_proc import restart_server, server_config, start_servers
from async_rl.launch.trainer_ranks import rank_cfg


def cfg(tmp_path: Path, *overrides: str) -> Config:
    return load_config(None, [f"run_dir={tmp_path}", *overrides])


def test_local_children_get_their_pools(tmp_path):
    c = cfg(tmp_path, "trainer.backend=fsdp", "trainer.world_size=2", "rollout.num_servers=2")
    launches = child_launches(c, place(c, visible=4, mask="4,5,6,7"))
    trainer_cfg, trainer_env, trainer_kwargs = launches["trainer"]
    assert trainer_env == {"CUDA_VISIBLE_DEVICES": "4,5"} and trainer_cfg.trainer.device == "cuda"
    assert trainer_kwargs == {}  # a GPU pool of its own: no memory cap
    rollout_cfg, rollout_env, rollout_kwargs = launches["rollout"]
    assert rollout_env == {"CUDA_VISIBLE_DEVICES": ""}  # the controller starts servers but uses no GPU
    assert [GpuSlot.from_wire(s).visible for s in rollout_kwargs["servers"]] == ["6", "7"]


def test_a_shared_gpu_caps_the_trainer_at_its_part(tmp_path):
    c = cfg(tmp_path, "engine.gpu_memory_fraction=0.25")
    trainer_cfg, env, kwargs = child_launches(c, place(c, visible=1))["trainer"]
    assert env == {"CUDA_VISIBLE_DEVICES": "0"} and kwargs == {"gpu_memory_fraction": 0.75}


def test_each_trainer_rank_builds_on_its_own_gpu(tmp_path):
    c = cfg(tmp_path, "trainer.backend=fsdp", "trainer.world_size=2")
    pool = child_launches(c, place(c, visible=8))["trainer"][0]  # one process, its ranks its children
    assert [rank_cfg(pool, r, None).trainer.device for r in (0, 1)] == ["cuda:0", "cuda:1"]
    own = for_process(c, "trainer", ray_slot(c, "trainer", [5]))  # Ray: each rank's process has its one GPU
    assert rank_cfg(own, 1, None).trainer.device == "cuda:0"


def test_a_cpu_run_starts_its_children_as_before(tmp_path):
    c = cfg(tmp_path)
    launches = child_launches(c, place(c, visible=0))
    assert launches["trainer"][1] == {} and launches["rollout"][1] == {}
    assert launches["trainer"][0].trainer.device == "cpu"


def test_each_server_starts_on_its_own_gpu(tmp_path, monkeypatch):
    """Before placement, servers past the first all started at cuda:0 or cycled over every GPU, the trainer's too."""
    calls = []

    def fake_launcher(scfg, index, env, starting):
        calls.append((index, scfg.engine.device, scfg.engine.gpu_memory_fraction, env))
        return SimpleNamespace(pid=100 + index), f"http://127.0.0.1:{9000 + index}"

    monkeypatch.setitem(servers.SERVER_LAUNCHERS, "embedded", fake_launcher)
    c = cfg(tmp_path, "rollout.num_servers=3")
    slots = list(place(c, visible=8).servers)
    start_servers(c, slots)
    assert sorted(calls) == [(i, "cuda:0", 0.85, {"CUDA_VISIBLE_DEVICES": str(i + 1)}) for i in range(3)]
    calls.clear()
    restart_server(c, slots, 2, 9002)  # a restarted server keeps its GPU
    assert calls == [(2, "cuda:0", 0.85, {"CUDA_VISIBLE_DEVICES": "3"})]


def test_sglang_runs_on_its_placed_gpu_within_the_inherited_mask(tmp_path, monkeypatch):
    """It used to set CUDA_VISIBLE_DEVICES to the server's index ("1"), discarding the mask. SGLang is not
    installed here: `engine.python` is a program that records how it was started and exits."""
    from async_rl.launch import sglang_server

    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {seen}.cmd\necho "$CUDA_VISIBLE_DEVICES" > {seen}.gpu\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    c = cfg(tmp_path, "engine.backend=sglang", "model.name=/models/x", "rollout.num_servers=2", "engine.port=30000",
            f"engine.python={fake}")
    slot = place(c, visible=4, mask="4,5,6,7").servers[1]
    with pytest.raises(RuntimeError, match="server 1 .*exited with code 1"):
        sglang_server.start_sglang(server_config(c, 1, 2, slot), 1, slot.env())
    assert (tmp_path / "seen.gpu").read_text().strip() == "6"  # physical: the trainer has 4, server 0 has 5
    cmd = (tmp_path / "seen.cmd").read_text().split()
    assert cmd[cmd.index("--port") + 1] == "30001"


@pytest.mark.gpu
def test_the_engine_sizes_its_kv_pool_from_its_share_of_the_gpu(tmp_path):
    import torch

    from async_rl.launch.serve import gpu_engine_config

    c = cfg(tmp_path, "engine.gpu_memory_fraction=0.2", "engine.kv_cache_mb=1")
    engine = gpu_engine_config(c, torch.device("cuda:0"))
    total = torch.cuda.mem_get_info(0)[1]
    assert 1 < engine.kv_cache_mb * 2**20 < 0.2 * total  # not the CPU budget, never past its share
    assert gpu_engine_config(c, torch.device("cpu")).kv_cache_mb == 1


def _write_env(cfg: Config, out: str) -> None:
    Path(out).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))


def test_spawn_sets_the_childs_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the user's mask: the child gets its part of it
    c = cfg(tmp_path)
    for env, expected in (({"CUDA_VISIBLE_DEVICES": "6"}, "6"), ({"CUDA_VISIBLE_DEVICES": ""}, ""), (None, "4,5,6,7")):
        proc = spawn("envcheck", f"{__name__}:_write_env", c, env=env, out=str(tmp_path / "env"))
        proc.join(60)
        assert proc.exitcode == 0 and (tmp_path / "env").read_text() == expected
