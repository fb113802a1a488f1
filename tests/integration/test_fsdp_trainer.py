"""The FSDP2 trainer backend: 2 CPU processes (gloo) against the single-process trainer.

Real processes, a real TCPStore and gloo process group, a tiny Llama built from the seed.
The batch of trajectories is fixed here (varied lengths, tool tokens, several micro-batches,
a micro-batch of one row so one rank runs an empty share), and both backends use the
same config, so after 3 steps losses and parameters must agree to 1e-5.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.config import Config, ModelConfig, TrainerConfig, load_config
from async_rl.trainer.backends import RankInfo, get_backend
from async_rl.trainer.checkpoint import load_checkpoint
from async_rl.types import Trajectory
from launch.common import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TOL = 1e-5


def _cfg(**trainer) -> Config:
    base = Config(model=ModelConfig(dtype="float32", tiny_alphabet="0123456789+= ", max_position=64),
                  trainer=TrainerConfig(compute_dtype="float32", device="cpu", lr=1e-4, grad_clip=1.0,
                                        batch_size=16, **trainer),
                  max_staleness=4, seed=3)
    return base


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


def _train(cfg: Config, rank: RankInfo) -> tuple[list[dict], dict[str, torch.Tensor]]:
    trainer = get_backend(cfg.trainer.backend).build(cfg, rank)
    stats = [trainer.train_step(_groups(s)) for s in range(STEPS)]
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
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    """Both cases trained by one pair of FSDP processes (saves a process start-up per case)."""
    out = tmp_path_factory.mktemp("fsdp")
    cfgs = {}
    for name, trainer in CASES.items():
        cfg = _cfg(**trainer)
        cfgs[name] = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, backend="fsdp", world_size=2))
    _run_fsdp(cfgs, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_two_processes_match_single_process(fsdp_runs, case):
    trainer = CASES[case]
    single_cfg = _cfg(**trainer)
    ref_stats, ref_weights, ref_trainer = _reference(single_cfg)
    got = torch.load(fsdp_runs / case / "fsdp.pt", weights_only=False)

    assert [s["train/optimizer_steps"] for s in ref_stats] == [trainer["minibatches"]] * STEPS
    for ref, ours in zip(ref_stats, got["stats"]):
        for key in ("train/loss", "train/clip_frac", "train/approx_kl", "train/behav_weight_max",
                    "train/grad_norm", "train/num_tokens", "train/staleness_max"):
            assert abs(ref[key] - ours[key]) <= TOL, (key, ref[key], ours[key])
    assert list(got["weights"]) == list(ref_weights)  # named as model.state_dict(), same order
    for name, ref in ref_weights.items():
        assert got["weights"][name].device.type == "cpu"
        assert torch.allclose(got["weights"][name], ref, atol=TOL, rtol=0), name
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
