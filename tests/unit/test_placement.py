"""GPU pools (async_rl/placement.py) over faked device counts and masks: no GPU needed.

The counts and masks are injected into the pure function; nothing here patches torch.
"""

import itertools

import pytest

from async_rl.config import ConfigError, load_config
from async_rl.placement import (ALONE_ENGINE_FRACTION, SHARED_ENGINE_FRACTION, for_process, kv_cache_bytes, place,
                                rank_device, ray_gpus, ray_slot)
from async_rl.launch.ray_host import plan as ray_plan

FSDP2 = ("trainer.backend=fsdp", "trainer.world_size=2")


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def visible(slots) -> list[str]:
    return [s.env()["CUDA_VISIBLE_DEVICES"] for s in slots]


def test_eight_gpus_give_disjoint_pools_trainer_first():
    plan = place(cfg(*FSDP2, "rollout.num_servers=2"), visible=8)
    assert plan.trainer.env() == {"CUDA_VISIBLE_DEVICES": "0,1"} and plan.trainer.device == "cuda"
    assert [rank_device(plan.trainer.device, r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert visible(plan.servers) == ["2", "3"] and {s.device for s in plan.servers} == {"cuda:0"}
    assert not plan.shared and plan.trainer.memory_fraction == 0
    assert plan.servers[0].memory_fraction == ALONE_ENGINE_FRACTION  # a GPU of its own: KV sized from most of it
    assert plan.lines == ("GPU pools: trainer on GPU 0,1; generation servers on GPU 2,3; idle: 4,5,6,7",)
    assert plan.cpu.env() == {"CUDA_VISIBLE_DEVICES": ""}  # the rollout controller never grabs a GPU


def test_one_gpu_is_shared_with_an_explicit_memory_split():
    plan = place(cfg(), visible=1)
    assert plan.shared and plan.trainer.visible == plan.servers[0].visible == "0"
    assert plan.servers[0].memory_fraction == SHARED_ENGINE_FRACTION
    assert plan.trainer.memory_fraction == pytest.approx(1 - SHARED_ENGINE_FRACTION)
    assert "share GPU 0: the engine takes 40% of its memory (engine.gpu_memory_fraction)" in plan.lines[0]
    split = cfg("engine.gpu_memory_fraction=0.3")
    plan = place(split, visible=1)
    assert (plan.servers[0].memory_fraction, plan.trainer.memory_fraction) == (0.3, 0.7)
    server = for_process(split, "rollout", plan.servers[0])
    assert (server.engine.device, server.engine.gpu_memory_fraction) == ("cuda:0", 0.3)
    assert for_process(split, "trainer", plan.trainer).trainer.device == "cuda:0"


def test_sglang_sharing_a_gpu_gets_mem_fraction_static():
    from async_rl.launch.sglang_server import sglang_command

    c = cfg("engine.backend=sglang", "model.name=/models/x")
    plan = place(c, visible=1)
    cmd = sglang_command(for_process(c, "rollout", plan.servers[0]), 30000)
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.4"
    alone = place(c, visible=2).servers[0]  # a GPU of its own: SGLang sizes its memory itself
    assert alone.env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert "--mem-fraction-static" not in sglang_command(for_process(c, "rollout", alone), 30000)


def test_dist_with_both_sides_on_one_gpu_is_refused_saying_what_to_use():
    with pytest.raises(ConfigError, match=r"^weight_sync.transport: dist needs the trainer and the generation server "
                                          r"on different GPUs \(NCCL refuses two ranks on one GPU, NVIDIA/nccl#418\), "
                                          r"but they share GPU 0; use weight_sync.transport=disk or zmq$"):
        place(cfg("weight_sync.transport=dist"), visible=1)
    assert not place(cfg("weight_sync.transport=dist"), visible=2).shared  # two GPUs: disjoint, NCCL is fine


def test_a_mask_maps_to_its_physical_gpus():
    plan = place(cfg(*FSDP2, "rollout.num_servers=2"), visible=4, mask="4,5,6,7")
    assert plan.trainer.visible == "4,5" and visible(plan.servers) == ["6", "7"]
    assert plan.lines == ("GPU pools (physical ids): trainer on GPU 4,5; generation servers on GPU 6,7",)
    plan = place(cfg("cluster.trainer_gpus=[3]", "cluster.rollout_gpus=[0]"), visible=4, mask="4,5,6,7")
    assert (plan.trainer.visible, plan.servers[0].visible) == ("7", "4")  # indices count within the mask
    assert place(cfg(), visible=2, mask="GPU-aa, GPU-bb").servers[0].visible == "GPU-bb"  # UUIDs pass through


def test_explicit_lists_and_devices_are_honoured():
    plan = place(cfg(*FSDP2, "cluster.trainer_gpus=[6,7]", "cluster.rollout_gpus=[0]"), visible=8)
    assert (plan.trainer.visible, plan.servers[0].visible) == ("6,7", "0")
    assert place(cfg("cluster.rollout_gpus=[0]"), visible=8).trainer.visible == "1"  # auto takes the first free
    plan = place(cfg("cluster.trainer_gpus=[2]", "cluster.rollout_gpus=[2]"), visible=8)  # sharing, chosen
    assert plan.shared and plan.servers[0].visible == "2"
    plan = place(cfg("engine.device=cuda:5"), visible=8)
    assert (plan.trainer.visible, plan.servers[0].visible) == ("0", "5")


def test_cpu_sides_are_unaffected_and_see_no_gpu_on_a_gpu_machine():
    for mask in (None, "0"):  # a CPU machine, with or without a mask exported out of habit
        plan = place(cfg(), visible=0, mask=mask)
        assert plan.trainer.env() == {} and plan.servers[0].env() == {} and plan.lines == ()
        assert plan.trainer.device == plan.servers[0].device == "cpu"
    plan = place(cfg("engine.device=cpu"), visible=2)
    assert plan.servers[0].env() == {"CUDA_VISIBLE_DEVICES": ""} and plan.servers[0].device == "cpu"
    assert plan.trainer.visible == "0"
    assert place(cfg("rollout.server_addrs=[http://h:1]"), visible=2).servers == ()


def test_one_side_alone_takes_the_machine_for_itself():
    assert place(cfg(), visible=1, sides=("trainer",)).servers == ()
    plan = place(cfg("weight_sync.transport=dist"), visible=1, sides=("rollout",))  # no trainer here: no sharing
    assert not plan.shared and plan.servers[0].visible == "0"


@pytest.mark.parametrize("overrides,count,mask,error", [
    ((*FSDP2, "rollout.num_servers=2", "cluster.trainer_gpus=[0,1]", "cluster.rollout_gpus=[1,2]"), 4, None,
     "cluster.rollout_gpus: GPU(s) [1] are also in cluster.trainer_gpus; the pools must not overlap"),
    (FSDP2, 1, None, "trainer.world_size: 2 ranks need 2 GPUs (one each), but 1 of the 1 visible are free"),
    (("rollout.num_servers=3",), 2, None, "rollout.num_servers: 3 servers need 3 GPUs of their own beside the "
                                          "trainer's 1 (trainer.world_size), but 1 of the 2 visible are left"),
    (("rollout.num_servers=2",), 1, None, "rollout.num_servers: 2 servers need 2 GPUs"),
    ((), 2, "4,5,6,7", "CUDA_VISIBLE_DEVICES: '4,5,6,7' names 4 GPU(s), but CUDA finds 2 of them here"),
    (("cluster.rollout_gpus=[4]",), 4, "4,5,6,7", "cluster.rollout_gpus: names GPU 4, but this process sees 4 "
                                                  "(cuda:0..3; indices count within CUDA_VISIBLE_DEVICES=4,5,6,7)"),
    (("cluster.trainer_gpus=[8]",), 8, None, "cluster.trainer_gpus: names GPU 8, but this process sees 8"),
    (("cluster.trainer_gpus=[0,1]",), 4, None, "cluster.trainer_gpus: lists 2 GPU(s) for trainer.world_size=1"),
    (("rollout.num_servers=2", "cluster.rollout_gpus=[1,1]"), 4, None, "cluster.rollout_gpus: names a GPU twice"),
    (("trainer.device=cuda",), 0, None, "trainer.device: 'cuda' needs a CUDA device, but none is visible here"),
    (("engine.device=cuda",), 0, "9", "engine.device: 'cuda' needs a CUDA device, but none is visible here "
                                      "(CUDA_VISIBLE_DEVICES='9')"),
    (("engine.backend=sglang",), 0, None, "engine.backend: sglang needs a CUDA GPU for each server"),
    (("engine.backend=sglang", "engine.device=cpu"), 2, None, "engine.device: engine.backend=sglang runs on CUDA"),
    ((*FSDP2, "trainer.device=cuda:0"), 2, None, "trainer.device: 'cuda:0' pins one GPU, but trainer.world_size=2"),
    (("engine.device=cuda:1", "cluster.rollout_gpus=[1]"), 2, None, "engine.device: 'cuda:1' and cluster.rollout_gpus"),
    (("engine.device=gpu",), 2, None, "engine.device: 'gpu' is not a device"),
    (("trainer.device=cpu", "cluster.trainer_gpus=[0]"), 2, None,
     "cluster.trainer_gpus: lists GPUs, but the trainer side runs on cpu (trainer.device=cpu)"),
    (("cluster.trainer_gpus=[0]",), 0, None, "cluster.trainer_gpus: lists GPUs, but the trainer side runs on cpu "
                                             "(no CUDA device is visible here)"),
    (("rollout.server_addrs=[http://h:1]", "cluster.rollout_gpus=[0]"), 2, None,
     "cluster.rollout_gpus: rollout.server_addrs is set, so no generation server starts here"),
    (("weight_sync.transport=dist", "cluster.trainer_gpus=[3]", "cluster.rollout_gpus=[3]"), 8, None,
     "weight_sync.transport: dist needs the trainer and the generation server on different GPUs"),
])
def test_an_impossible_request_is_one_error_naming_the_key(overrides, count, mask, error):
    with pytest.raises(ConfigError) as info:
        place(cfg(*overrides), visible=count, mask=mask)
    assert str(info.value).startswith(error) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("count,world,servers", itertools.product(range(1, 9), range(1, 5), range(1, 5)))
def test_every_placement_is_one_gpu_per_process_within_the_mask(count, world, servers):
    mask = ",".join(str(8 + 2 * i) for i in range(count))  # physical ids that are not the indices
    try:
        plan = place(cfg("trainer.backend=fsdp", f"trainer.world_size={world}", f"rollout.num_servers={servers}"),
                     visible=count, mask=mask)
    except ConfigError as exc:
        assert world + servers > count and str(exc).split(":")[0] in ("trainer.world_size", "rollout.num_servers")
        return
    trainer = plan.trainer.visible.split(",")
    ids = trainer + visible(plan.servers)
    assert len(trainer) == world and len(plan.servers) == servers
    assert set(ids) <= set(mask.split(","))
    assert len(set(ids)) == len(ids) or (plan.shared and count == 1 and world == servers == 1)


# ---------------------------------------------------------------------------------------- memory split
def test_kv_pool_is_the_engines_share_less_its_weights_and_reserve():
    gib = 2**30
    kv = kv_cache_bytes(fraction=0.4, total=80 * gib, free=70 * gib, held=2 * gib, bucket=gib // 8)
    assert kv == int(0.4 * 80 * gib) - 2 * gib - int(0.1 * 0.4 * 80 * gib) - gib // 8
    assert kv_cache_bytes(fraction=0.9, total=80 * gib, free=10 * gib, held=0, bucket=0) < 10 * gib  # only what is free
    with pytest.raises(ConfigError, match=r"^engine.gpu_memory_fraction: 0.05 of 16.0 GiB leaves no KV cache"):
        kv_cache_bytes(fraction=0.05, total=16 * gib, free=16 * gib, held=gib, bucket=0)


def test_memory_fraction_must_leave_the_trainer_something():
    with pytest.raises(ConfigError, match=r"^engine.gpu_memory_fraction: must be in \[0, 1\)"):
        cfg("engine.gpu_memory_fraction=1.0")


def test_a_tensor_parallel_server_holds_tp_size_gpus():
    """engine.tp_size=2 used to start each server on one GPU while SGLang was told --tp-size 2: it could not start."""
    plan = place(cfg("engine.backend=vllm", "rollout.num_servers=2", "engine.tp_size=2"), visible=8)
    assert plan.trainer.visible == "0" and visible(plan.servers) == ["1,2", "3,4"]
    assert {s.device for s in plan.servers} == {"cuda:0"}  # its ranks see cuda:0 and cuda:1
    listed = place(cfg("engine.backend=sglang", "engine.tp_size=2", "cluster.rollout_gpus=[6,7]"), visible=8)
    assert visible(listed.servers) == ["6,7"]
    with pytest.raises(ConfigError, match=r"^cluster.rollout_gpus: lists 1 GPU\(s\) for rollout.num_servers=1 "
                                          r"\(engine.tp_size=2 per server\)"):
        place(cfg("engine.backend=sglang", "engine.tp_size=2", "cluster.rollout_gpus=[6]"), visible=8)
    with pytest.raises(ConfigError, match=r"^rollout.num_servers: 2 servers need 4 GPUs of their own \(2 each: "
                                          r"engine.tp_size\) beside the trainer's 1"):
        place(cfg("engine.backend=vllm", "rollout.num_servers=2", "engine.tp_size=2"), visible=4)
    assert ray_gpus(cfg("engine.backend=vllm", "engine.tp_size=2"), 8)["server"] == 2.0  # a Ray bundle too


# ---------------------------------------------------------------------------------------- Ray
def test_ray_bundles_are_whole_gpus_where_a_side_runs_on_cuda():
    slots = ray_plan(cfg(*FSDP2, "rollout.num_servers=2"), cluster_gpus=8)
    bundles = {s.name: s.bundle for s in slots}
    assert [bundles[n]["GPU"] for n in ("server", "server1", "trainer0", "trainer1")] == [1.0] * 4
    assert "GPU" not in bundles["rollout"]
    assert all("GPU" not in s.bundle for s in ray_plan(cfg(*FSDP2), cluster_gpus=0))  # a CPU cluster: as before
    assert ray_gpus(cfg("engine.device=cpu"), 8) == {"trainer": 1.0, "server": 0.0}
    assert ray_gpus(cfg("engine.backend=sglang", "trainer.device=cpu"), 0) == {"trainer": 0.0, "server": 1.0}
    assert ray_gpus(cfg("ray.num_gpus_per_trainer=1"), 0)["trainer"] == 1.0  # asked for: placement says if it fits


@pytest.mark.parametrize("overrides,error", [
    (("ray.num_gpus_per_server=0.5",), "ray.num_gpus_per_server: a server on CUDA takes one whole GPU"),
    (("ray.num_gpus_per_trainer=2",), "ray.num_gpus_per_trainer: a trainer on CUDA takes one whole GPU"),
    (("trainer.device=cpu", "ray.num_gpus_per_trainer=1"), "ray.num_gpus_per_trainer: trainer.device=cpu, so a "
                                                           "trainer would hold a GPU it never uses"),
    (("cluster.trainer_gpus=[0]",), "cluster.trainer_gpus: launcher=ray gives each process the GPU Ray assigns"),
    (("engine.device=cuda:1",), "engine.device: 'cuda:1' names a GPU, but under launcher=ray"),
])
def test_ray_bundle_mistakes_are_one_error_naming_the_key(overrides, error):
    with pytest.raises(ConfigError) as info:
        ray_gpus(cfg(*overrides), cluster_gpus=8)
    assert str(info.value).startswith(error), str(info.value)


def test_a_ray_process_runs_on_the_gpu_ray_assigned_and_a_cpu_bundle_sees_none():
    slot = ray_slot(cfg(), "trainer", [3])
    assert slot.env() == {"CUDA_VISIBLE_DEVICES": "3"} and slot.device == "cuda:0"
    assert rank_device(slot.device, 1) == "cuda:0"  # rank 1 in its own bundle: its one GPU, not cuda:1
    assert ray_slot(cfg(), "rollout", ["5"]).memory_fraction == ALONE_ENGINE_FRACTION
    assert ray_slot(cfg(), None, []).env() == {"CUDA_VISIBLE_DEVICES": ""}  # Ray 2.60 would leave every GPU visible
