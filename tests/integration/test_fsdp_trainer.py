"""The FSDP2 trainer backend: 2 CPU processes (gloo) against the single-process trainer.

Real processes, a real TCPStore and gloo process group, a tiny Llama built from the seed.
The batch of trajectories is fixed here (varied lengths, tool tokens, several micro-batches,
a micro-batch of one row so one rank runs an empty share), and both backends use the
same config, so after 3 steps losses and parameters must agree to 1e-5. The learning rate
is small (1e-4) because Adam's first steps move a weight by about lr * sign(grad): where a
gradient is rounding noise, float32 summation order alone moves it by up to ~lr/10.

Also: the world-size checks, a publish read from the shards tensor by tensor (`weights()`,
the other rank gathering along, also when the publish stops midway), and a follower rank
that leaves when rank 0 dies.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.config import Config, ModelConfig, TrainerConfig
from async_rl.placement import gpus_here, place, rank_device
from async_rl.trainer.backends import RankInfo, get_backend
from async_rl.trainer.checkpoint import load_checkpoint
from async_rl.transport.codec import decode
from async_rl.types import Trajectory
from async_rl.weight_sync.disk import DiskWeightPublisher, load_weights
from async_rl.launch.common import free_port
from async_rl.launch.trainer_ranks import follower_main, lead

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TOL = 1e-5


def _cfg(device: str = "cpu", **trainer) -> Config:
    return Config(model=ModelConfig(dtype="float32", tiny_alphabet="0123456789+= ", max_position=64),
                  trainer=TrainerConfig(compute_dtype="float32", device=device, lr=1e-4, grad_clip=1.0,
                                        batch_size=16, **trainer),
                  max_staleness=4, seed=3)


def _fsdp(cfg: Config) -> Config:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, backend="fsdp", world_size=2))


def _groups(step: int) -> list[list[Trajectory]]:
    """4 prompts x 4 answers; lengths 2..14 tokens, some tool tokens (mask 0), rewards 0/1."""
    rng = np.random.default_rng(100 + step)
    groups = []
    for g in range(4):
        prompt = rng.integers(3, 16, size=2 + g).astype(np.int32)
        group = []
        for i in range(4):
            r = 1 + (3 * g + 5 * i) % 9
            mask = (rng.random(r) > 0.2).astype(np.uint8)
            mask[0] = 1
            group.append(Trajectory(
                id=f"s{step}g{g}i{i}", group_id=f"s{step}g{g}", prompt_ids=prompt,
                response_ids=rng.integers(3, 16, size=r).astype(np.int32), loss_mask=mask,
                behav_logprobs=np.where(mask, -rng.uniform(0.5, 4.0, size=r), 0.0).astype(np.float32),
                versions=np.where(mask, step, -1).astype(np.int32), reward=float((g + i) % 2),
                finish_reason="stop"))
        groups.append(group)
    return groups


def step(trainer, rank: int, groups: list[list[Trajectory]]) -> dict:
    """One train step as the launch layer drives it: rank 0 gets the batch, the others their rows from it."""
    return trainer.train_step(groups) if rank == 0 else trainer.follow_train_step()


def _train(cfg: Config, rank: RankInfo) -> tuple[list[dict], dict[str, torch.Tensor]]:
    device = rank_device(cfg.trainer.device, rank.rank)  # as the launch layer gives each rank its GPU
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device=device))
    trainer = get_backend(cfg.trainer.backend).build(cfg, rank)
    stats = [step(trainer, rank.rank, _groups(s)) for s in range(STEPS)]
    weights = trainer.state_dict()
    return stats, weights, trainer


def _reference(cfg: Config):
    """The single-process run, on one thread like each FSDP rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(cfg, RankInfo())
    finally:
        torch.set_num_threads(threads)


def _rank_main(rank: int, cfgs: dict[str, Config], port: int, out: str, errors) -> None:
    """One FSDP rank: train each config in turn (one process group), rank 0 saves what it got."""
    try:
        torch.set_num_threads(1)
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
        trainer = None
        for name, cfg in cfgs.items():
            stats, weights, trainer = _train(cfg, RankInfo(rank, 2, store, timeout_s=60))
            trainer.save_checkpoint(str(Path(out) / name / "ckpt"), STEPS, {"policy_version": trainer.policy_version})
            if rank == 0:
                torch.save({"stats": stats, "weights": weights}, Path(out) / name / "fsdp.pt")
        trainer.close()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _run_fsdp(cfgs: dict[str, Config], out: Path) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, cfgs, port, str(out), errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), errors.get(timeout=5) if not errors.empty() else "a rank hung"


CASES = {
    "one-micro-batch": {"micro_batch_tokens": 4096, "minibatches": 1},  # each rank runs half the rows
    "micro-batches+minibatches": {"micro_batch_tokens": 40, "minibatches": 2},  # prox recompute, one-row shares
    # per-sequence weights computed over the minibatch before the rows are split between the ranks
    "seq-mean": {"micro_batch_tokens": 40, "minibatches": 2, "loss_agg": "seq_mean_token_mean"},
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    """Both cases trained by one pair of FSDP processes (saves a process start-up per case)."""
    out = tmp_path_factory.mktemp("fsdp")
    _run_fsdp({name: _fsdp(_cfg(**trainer)) for name, trainer in CASES.items()}, out)
    return out


def _assert_same_training(ref_stats: list[dict], ref_weights: dict, got: dict) -> None:
    """Losses, stats and weights of an FSDP run equal the single-process run's within TOL."""
    for ref, ours in zip(ref_stats, got["stats"]):
        for key in ("train/loss", "train/clip_frac", "train/approx_kl", "train/behav_weight_max",
                    "train/grad_norm", "train/num_tokens", "train/staleness_max", "train/entropy",
                    "train/grad_norm_clipped", "train/kl_prev"):
            assert abs(ref[key] - ours[key]) <= TOL, (key, ref[key], ours[key])
    assert list(got["weights"]) == list(ref_weights)  # named as model.state_dict(), same order
    for name, ref in ref_weights.items():
        assert got["weights"][name].device.type == "cpu"
        assert torch.allclose(got["weights"][name], ref, atol=TOL, rtol=0), name


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_two_processes_match_single_process(fsdp_runs, case):
    trainer = CASES[case]
    single_cfg = _cfg(**trainer)
    ref_stats, ref_weights, ref_trainer = _reference(single_cfg)
    got = torch.load(fsdp_runs / case / "fsdp.pt", weights_only=False)
    assert [s["train/optimizer_steps"] for s in ref_stats] == [trainer["minibatches"]] * STEPS
    _assert_same_training(ref_stats, ref_weights, got)
    initial = get_backend("single").build(single_cfg, RankInfo()).state_dict()
    assert any(not torch.equal(initial[n], ref_weights[n]) for n in ref_weights)  # training moved them
    # tied embedding and LM head: one tensor in the gathered dict too
    w = got["weights"]
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    # the checkpoint holds full tensors: it loads into a plain model and optimizer
    meta = load_checkpoint(fsdp_runs / case / "ckpt", ref_trainer.model, ref_trainer.optimizer)
    assert meta == {"step": STEPS, "policy_version": STEPS}
    for name, t in ref_trainer.model.state_dict().items():
        assert torch.allclose(t, ref_weights[name], atol=TOL, rtol=0), name


# ---------------------------------------------------------------------------------------- bad input
def test_world_size_beyond_this_machine_is_one_clear_error():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"^trainer.world_size: {cores + 1} CPU ranks need at least {cores + 1} cores"):
        get_backend("fsdp").check(Config(trainer=TrainerConfig(backend="fsdp", world_size=cores + 1, device="cpu")))
    with pytest.raises(ValueError, match=r"^trainer.world_size: the single backend runs one process, got 2"):
        get_backend("single").check(Config(trainer=TrainerConfig(world_size=2, device="cpu")))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^trainer.device: 'cuda' asked for, but this machine has no CUDA"):
            get_backend("fsdp").check(Config(trainer=TrainerConfig(backend="fsdp", world_size=2, device="cuda")))
    with pytest.raises(ValueError, match=r"^trainer.backend: must be one of single\|fsdp\|megatron, got 'deepspeed'"):
        get_backend("deepspeed")


# ---------------------------------------------------------------------------------------- lock step
class _Frames:
    """The store of rank 0's Leader, recording the size and keys of every command frame it writes."""

    def __init__(self, store):
        self.store, self.frames = store, []

    def set(self, key, value):
        self.frames.append((len(value), sorted(decode(value))))
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _leader_then_vanish(cfg: Config, port: int, ready: str) -> None:
    """Rank 0 that trains a step, then one with nothing fresh enough (no collective), then sits until killed."""
    torch.set_num_threads(1)
    trainer = lead(cfg, 2, "127.0.0.1", port)
    trainer.store = _Frames(trainer.store)
    stats = trainer.train_step(_groups(0))
    assert trainer.train_step(_groups(-10))["train/dropped_stale"] == 16  # the follower must not lose count
    full = trainer.state_dict()  # rank 0 gets the full weights; the follower joined the gather
    assert full
    for v in (1, 2):  # published tensor by tensor as the publisher reads them (the second deletes the first's keys)
        msg = DiskWeightPublisher(Path(ready).parent / "weights", keep_last=2).publish(trainer.weights(), v)
        got = load_weights(msg["path"])
        assert set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    partial = trainer.weights()  # a publish that fails after two tensors: close() gathers the rest
    partial.get(partial.names[1])
    partial.close()
    assert trainer.state_dict().keys() == full.keys()  # the ranks are still in step
    assert 1 not in trainer._unread  # a frame every follower has read is deleted from the store
    Path(ready).write_text(json.dumps({"loss": stats["train/loss"], "frames": trainer.store.frames}))
    time.sleep(600)


def _follower(cfg: Config, port: int, errors, received: str) -> None:
    """Rank 1 as a launcher runs it, recording the rows each train step brought it over the process group."""
    from async_rl.trainer.backends import spmd

    def recording(device, _recv=spmd.recv_shares):
        shares = _recv(device)
        # per micro-batch: (rows, trajectories); a packed row holds several, each starting at position 0
        rows = None if shares is None else [[(int(b.batch_size[0]), int((b.position_ids == 0).sum())) for b in s.micros]
                                            for s in shares]
        with open(received, "a") as f:
            f.write(json.dumps(rows) + "\n")
        return shares

    spmd.recv_shares = recording
    try:
        follower_main(cfg, 1, 2, "127.0.0.1", port)
    except BaseException as exc:
        errors.put(f"{type(exc).__name__}: {exc}")
        raise


def test_follower_leaves_when_rank0_dies(tmp_path):
    """Also: a step's batch reaches the follower over the process group (its rows only), not the store."""
    cfg = _fsdp(_cfg(micro_batch_tokens=4096))
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port, ready, received = free_port(), tmp_path / "ready", tmp_path / "received.jsonl"
    leader = ctx.Process(target=_leader_then_vanish, args=(cfg, port, str(ready)))
    follower = ctx.Process(target=_follower, args=(cfg, port, errors, str(received)))
    leader.start()
    follower.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and leader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "rank 0 did not finish its step"
        time.sleep(0.5)
        assert follower.is_alive()  # waiting for the next command: rank 0 may wait long for rollout data
        leader.kill()
        follower.join(20)
        assert not follower.is_alive(), "the follower hung after rank 0 died"
        assert follower.exitcode != 0
        assert "LeaderLost: trainer rank 0 went away" in errors.get(timeout=5)
    finally:
        for p in (leader, follower):
            if p.is_alive():
                p.kill()
    frames = json.loads(ready.read_text())["frames"]
    # train_step x2, state_dict, weights x3, state_dict: command names only, never the data
    assert [keys for _, keys in frames] == [["op"]] * 7
    assert max(size for size, _ in frames) < 64, frames
    # step 0: one micro-batch of 16 trajectories, rank 1 holds 1, 3, ..., 15 packed in one row; step 1 trained nothing
    got = [json.loads(line) for line in received.read_text().splitlines()]
    assert got == [[[[1, 8]]], None], got


# ---------------------------------------------------------------------------------------- CUDA (NCCL)
@pytest.mark.gpu
def test_cuda_world_size_beyond_visible_gpus_is_one_clear_error():
    """On this machine's real GPUs (tests/unit/test_placement.py fakes the counts)."""
    visible, mask = gpus_here()
    fsdp = Config(trainer=TrainerConfig(backend="fsdp", world_size=visible + 1, device="cuda"))
    with pytest.raises(ValueError, match=rf"^trainer.world_size: {visible + 1} ranks need {visible + 1} GPUs"):
        place(fsdp, visible=visible, mask=mask, sides=("trainer",))
    pinned = Config(trainer=TrainerConfig(backend="fsdp", world_size=2, device="cuda:0"))
    with pytest.raises(ValueError, match=r"^trainer.device: 'cuda:0' pins one GPU"):
        place(pinned, visible=visible, mask=mask)


@pytest.mark.gpu
def test_fsdp_on_two_gpus_matches_one_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one per rank)")
    cfg = _cfg("cuda", **CASES["micro-batches+minibatches"])
    _run_fsdp({"cuda": _fsdp(cfg)}, tmp_path)
    ref_stats, ref_weights, _ = _reference(cfg)
    _assert_same_training(ref_stats, {k: v.cpu() for k, v in ref_weights.items()},
                          torch.load(tmp_path / "cuda" / "fsdp.pt", weights_only=False))


# ---------------------------------------------------------------------------------------- shares
def _exchange_rank(rank: int, port: int, out: str, errors) -> None:
    """Rank 0 sends three steps' shares (rows; trajectories with nothing trained; rows again), rank 1 receives."""
    from async_rl.trainer.backends.spmd import recv_shares, send_shares
    from async_rl.trainer.batching import collate
    from async_rl.trainer.plan import Share

    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
        trajs = [t for g in _groups(0) for t in g][:4]
        batch = collate(trajs, torch.ones(4), [0, 1, 2, 3])
        steps = [[Share(total=batch.num_tokens, micros=[batch], tokens=[batch.num_tokens])],
                 [Share(total=0, micros=[], tokens=[])],
                 [Share(total=batch.num_tokens, micros=[batch[1:3]], tokens=[batch[1:3].num_tokens])]]
        if rank == 0:
            for shares in steps:
                send_shares(shares, 1, torch.device("cpu"))
        else:
            got = [recv_shares(torch.device("cpu")) for _ in steps]
            for want, have in zip(steps, got):
                assert [s.total for s in have] == [s.total for s in want]
                assert [s.tokens for s in have] == [s.tokens for s in want]
                for a, b in zip(want, have):
                    assert len(a.micros) == len(b.micros)
                    for x, y in zip(a.micros, b.micros):
                        assert all(torch.equal(x.get(k), y.get(k)) for k in x.to_tensordict().keys())
            Path(out, "ok").write_text("ok")
        torch.distributed.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_shares_arrive_whole_and_a_step_without_rows_sends_none(tmp_path):
    from tests.integration.test_resume_ranks import _run

    port = free_port()
    _run([(_exchange_rank, (0, port)), (_exchange_rank, (1, port))], tmp_path)
    assert (tmp_path / "ok").read_text() == "ok"
