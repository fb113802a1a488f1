"""Resuming the FSDP2 trainer of 2 CPU ranks (gloo) trains exactly what the uninterrupted run trains.

Real processes, a real TCPStore and gloo process group, a tiny Llama built from the seed
(MLP width 63: those weights' 63 rows split 32 + 31, so shards are uneven). A run trains 4
fixed batches with a checkpoint after step 2; a fresh trainer (initial weights, fresh
optimizer and RNG) loads that checkpoint and trains steps 2 and 3: losses within 1e-6 and
the same final weights. Two minibatches per step, so the restored RNG (the minibatch split)
and Adam's moments both matter. The same through rank 0's `Leader` with a follower process
(the follower hears `load_checkpoint` and loads its own shard), from a checkpoint the single
backend wrote, and bad checkpoints: one clear error on every rank, none hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from async_rl.config import Config, ModelConfig, TrainerConfig
from async_rl.trainer.backends import RankInfo, get_backend
from async_rl.trainer.backends.scatter import shard_rows
from async_rl.launch.common import free_port
from async_rl.launch.trainer_ranks import follower_main, lead
from tests.integration.test_fsdp_trainer import _groups, step  # 4 prompts x 4 answers, fixed per step

STEPS, K = 4, 2  # train 4 steps, checkpoint after 2
TOL = 1e-6


def _cfg(backend: str = "fsdp") -> Config:
    return Config(model=ModelConfig(dtype="float32", tiny_intermediate=63, max_position=64),
                  trainer=TrainerConfig(compute_dtype="float32", device="cpu", lr=1e-3, grad_clip=1.0, batch_size=16,
                                        minibatches=2, micro_batch_tokens=40, num_threads=1, backend=backend,
                                        world_size=2 if backend == "fsdp" else 1),
                  max_staleness=4, seed=5)


def _train(trainer, steps: range, ckpt: Path | None = None, rank: int = 0) -> list[float]:
    """Losses as rank 0 sees them (the other ranks' steps report nothing: `follow_train_step`)."""
    losses = []
    for s in steps:
        if ckpt is not None and s == K:
            trainer.save_checkpoint(str(ckpt), K, {"policy_version": trainer.policy_version,
                                                   "rng": trainer.rng_state()})
        losses.append(step(trainer, rank, _groups(s)).get("train/loss"))
    return losses


def _try_load(trainer, path: Path) -> str:
    try:
        trainer.load_checkpoint(str(path))
    except Exception as exc:  # noqa: BLE001 -- the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _other_model(src: Path, dst: Path) -> None:
    """A copy of a checkpoint whose embedding has one row fewer (another vocabulary)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:-1].clone()
    save_file(tensors, str(dst / "model.safetensors"))


def _spmd_rank(rank: int, port: int, out: str, errors) -> None:
    """Both ranks: the uninterrupted run, a resumed one, a resume from the single backend, bad checkpoints."""
    try:
        torch.set_num_threads(1)
        out_dir, build = Path(out), get_backend("fsdp").build
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
        info = RankInfo(rank, 2, store, timeout_s=60)
        full = build(_cfg(), info)
        result = {"full": _train(full, range(STEPS), ckpt=out_dir / "ckpt", rank=rank), "full_w": full.state_dict()}
        resumed = build(_cfg(), info)
        result["meta"] = resumed.load_checkpoint(str(out_dir / "ckpt"))
        result["version"] = resumed.policy_version
        result["resumed"] = _train(resumed, range(K, STEPS), rank=rank)
        result["resumed_w"] = resumed.state_dict()
        from_single = build(_cfg(), info)
        from_single.load_checkpoint(str(out_dir / "single_ckpt"))
        result["from_single"] = _train(from_single, range(K, STEPS), rank=rank)
        if rank == 0:
            _other_model(out_dir / "ckpt", out_dir / "other")
        torch.distributed.barrier()
        result["errors"] = {"missing": _try_load(resumed, out_dir / "nope"),
                            "other_model": _try_load(resumed, out_dir / "other"),
                            "rank1_cannot_read": _try_load(resumed, out_dir / ("ckpt" if rank == 0 else "nope"))}
        torch.save(result, out_dir / f"rank{rank}.pt")
        resumed.close()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _run(targets: list, out: Path) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, str(out), errors)) for target, args in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), errors.get(timeout=5) if not errors.empty() else \
        f"exit codes {[p.exitcode for p in procs]} (None: hung)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume_ranks")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the single backend's run, checkpointed after step K (its own tensor naming, tied weights once)
        single = get_backend("single").build(_cfg("single"), RankInfo())
        torch.save({"losses": _train(single, range(STEPS), ckpt=out / "single_ckpt")}, out / "single.pt")
    finally:
        torch.set_num_threads(threads)
    port = free_port()
    _run([(_spmd_rank, (0, port)), (_spmd_rank, (1, port))], out)
    return out


def _close(got: list[float], want: list[float], tol: float = TOL) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= tol for g, w in zip(got, want))


def test_shard_rows_split_like_torch_chunk():
    for n in (0, 1, 5, 7, 15, 16):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(n).chunk(world) if n else ()
            for r in range(world):
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(n))[shard_rows(n, r, world)] == want, (n, world, r)


def test_resumed_fsdp_run_trains_what_the_uninterrupted_run_trains(runs):
    r0 = torch.load(runs / "rank0.pt", weights_only=False)
    r1 = torch.load(runs / "rank1.pt", weights_only=False)
    assert r0["meta"]["step"] == K and r0["version"] == r1["version"] == K
    assert r0["full"] == r1["full"]  # every rank reports the combined stats
    assert r0["full"][K] != r0["full"][K - 1]
    assert _close(r0["resumed"], r0["full"][K:]), (r0["resumed"], r0["full"][K:])
    assert _close(r1["resumed"], r1["full"][K:])
    assert r1["full_w"] == {} and r1["resumed_w"] == {}  # full weights come to rank 0 only
    for name, want in r0["full_w"].items():
        assert torch.allclose(r0["resumed_w"][name], want, atol=TOL, rtol=0), name
    # a checkpoint the single backend wrote: the fsdp ranks continue its run (float summation order
    # differs between one process and two, hence the looser bound)
    single = torch.load(runs / "single.pt")["losses"]
    assert _close(r0["from_single"], single[K:], tol=1e-5), (r0["from_single"], single[K:])


def test_bad_checkpoint_is_one_clear_error_on_every_rank(runs):
    e0 = torch.load(runs / "rank0.pt", weights_only=False)["errors"]
    e1 = torch.load(runs / "rank1.pt", weights_only=False)["errors"]
    for errs in (e0, e1):
        assert errs["missing"].startswith("FileNotFoundError: ") and "not a checkpoint directory" in errs["missing"]
        assert errs["other_model"].startswith("ValueError: "), errs["other_model"]
        assert "model.embed_tokens.weight has shape (15, 64), the model's is (16, 64)" in errs["other_model"]
    # a rank that cannot see the file (no shared file system): it says why, the others name it
    assert e1["rank1_cannot_read"].startswith("FileNotFoundError: ")
    assert e0["rank1_cannot_read"].startswith("RuntimeError: trainer.resume: trainer rank(s) [1] could not load")
    assert "file system all ranks see" in e0["rank1_cannot_read"]


# ---------------------------------------------------------------------------------------- Leader
def _leader(ckpt: str, port: int, out: str, errors) -> None:
    """Rank 0 as the trainer process runs it: load_checkpoint and train_step are announced to rank 1."""
    try:
        torch.set_num_threads(1)
        trainer = lead(_cfg(), 2, "127.0.0.1", port)
        meta = trainer.load_checkpoint(ckpt)
        losses = _train(trainer, range(K, STEPS))
        torch.save({"meta": meta, "version": trainer.policy_version, "losses": losses,
                    "weights": trainer.state_dict()}, Path(out) / "leader.pt")
        trainer.close()
    except BaseException:
        errors.put(f"leader: {traceback.format_exc()}")
        raise


def _follower(port: int, out: str, errors) -> None:
    try:
        follower_main(_cfg(), 1, 2, "127.0.0.1", port)
    except BaseException:
        errors.put(f"follower: {traceback.format_exc()}")
        raise


def test_leader_and_follower_resume_together(runs, tmp_path):
    port = free_port()
    _run([(_leader, (str(runs / "ckpt"), port)), (_follower, (port,))], tmp_path)
    got = torch.load(tmp_path / "leader.pt", weights_only=False)
    want = torch.load(runs / "rank0.pt", weights_only=False)
    assert got["meta"]["step"] == K and got["version"] == STEPS
    assert _close(got["losses"], want["full"][K:]), (got["losses"], want["full"][K:])
    for name, w in want["full_w"].items():
        assert torch.allclose(got["weights"][name], w, atol=TOL, rtol=0), name
