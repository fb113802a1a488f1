"""The megatron backend's GPU-only parts, run whenever a CUDA device is present (skipped on CPU,
where tests/e2e/test_megatron_run.py checks that each is refused with one line):

- the Transformer Engine spec (norms fused into linear_qkv / linear_fc1) with bf16 autocast over
  fp32 master weights: 3 steps track the single backend's bf16 steps on the same GPU;
- packed THD micro-batches (`trainer.pack_sequences`, TE's cu_seqlens attention) give the log-probs
  of padded rows.

One process (NCCL, world size 1) per test, the fixed batches of the fsdp tests.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import pytest
import torch

from async_rl.config import Config
from async_rl.trainer.backends import RankInfo, get_backend
from async_rl.launch.common import free_port
from tests.integration.test_fsdp_trainer import _cfg, _groups
from tests.integration.test_resume_ranks import _run

pytestmark = pytest.mark.gpu


def _te_cfg(**trainer) -> Config:
    cfg = _cfg("cuda:0", micro_batch_tokens=40, minibatches=2, compute_dtype="bfloat16")
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, backend="megatron", megatron_spec="te",
                                                                **trainer))


def _gpu_main(case: str, port: int, out: str, errors) -> None:
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
        trainer = get_backend("megatron").build(_te_cfg(pack_sequences=case == "packed"), RankInfo(0, 1, store))
        result = {}
        if case == "packed":
            trajs = [t for g in _groups(0) for t in g]
            batch = trainer._shares(trajs, torch.zeros(16), trainer._plan(trajs))[0].micros[0]
            with torch.no_grad():
                packed = trainer._logprobs(batch)
                trainer.model.packed = False
                padded = trainer._logprobs(batch)
            result = {"diff": float((packed - padded).abs().max()), "tokens": batch.num_tokens}
        else:
            result = {"stats": [trainer.train_step(_groups(s)) for s in range(3)], "weights": trainer.state_dict()}
        torch.save(result, Path(out) / f"{case}.pt")
        trainer.close()
    except BaseException:
        errors.put(f"{case}: {traceback.format_exc()}")
        raise


def _needs_te() -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformer_engine", reason="the TE spec and THD packing need Transformer Engine")


def test_te_spec_in_bf16_tracks_the_single_backend(tmp_path):
    _needs_te()
    _run([(_gpu_main, ("te", free_port()))], tmp_path)
    got = torch.load(tmp_path / "te.pt", weights_only=False)
    single = get_backend("single").build(_cfg("cuda:0", micro_batch_tokens=40, minibatches=2,
                                              compute_dtype="bfloat16"), RankInfo())
    ref = [single.train_step(_groups(s)) for s in range(3)]
    for a, b in zip(ref, got["stats"]):  # bf16 matmuls in two implementations: close, not equal
        assert abs(a["train/loss"] - b["train/loss"]) < 2e-2, (a["train/loss"], b["train/loss"])
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 5e-2 * max(1.0, a["train/grad_norm"])
    weights = single.state_dict()
    for name, w in weights.items():
        assert torch.allclose(got["weights"][name], w, atol=5e-3, rtol=0), name


def test_packed_thd_micro_batches_give_the_padded_logprobs(tmp_path):
    _needs_te()
    _run([(_gpu_main, ("packed", free_port()))], tmp_path)
    got = torch.load(tmp_path / "packed.pt")
    assert got["tokens"] > 0
    assert got["diff"] < 2e-2, got  # bf16 autocast on both paths
