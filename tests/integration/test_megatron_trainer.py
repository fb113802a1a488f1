"""The megatron trainer backend on CPU (gloo, fp32, local spec) against the single backend and itself.

Real processes, a real TCPStore and gloo process group, the tiny Llama of the fsdp tests
(4 heads, 2 KV heads, vocabulary 16: all divide by 2) and their fixed batches: several
micro-batches, two minibatches (the proximal recompute and the minibatch RNG), one-row
micro-batches (an idle data-parallel share). After 3 steps losses, grad norms and every
weight agree within 1e-5:

- megatron TP=1 (x DP=2) equals `single` (rows sent over the process group, the data-parallel
  gradient all-reduce);
- TP=2 (x DP=1) equals that TP=1 run (vocab-parallel log-probs, the TP gathers and conversions,
  the clipping norm counting replicated parameters once);
- a TP=2 run resumed from its step-2 checkpoint repeats the uninterrupted losses, and that
  checkpoint is a plain HF directory (`AutoModelForCausalLM.from_pretrained`) of the same weights;
- a real GPTModel given tiny random Llamas through megatron_layout (tied 9 heads / 3 KV heads,
  untied 8 / 2 with head_dim 12 != hidden / heads) gives the HF log-probs within 1e-5 and
  converts back bit-exact, while a deliberately wrong qkv layout (q, k, v concatenated, not
  interleaved per query group) is off by far more: the check catches a layout mistake.

Everything runs in one pair of processes (one process group; megatron's model-parallel state
is rebuilt per layout), so the file pays for two process starts.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")

from async_rl.config import Config  # noqa: E402
from async_rl.trainer.backends import RankInfo, get_backend  # noqa: E402
from async_rl.trainer.backends.megatron_layout import LlamaShape, interleave_qkv, params, to_hf, to_shard  # noqa: E402
from async_rl.launch.common import free_port  # noqa: E402
from tests.integration.test_fsdp_trainer import _cfg, _groups, _reference, step  # noqa: E402
from tests.integration.test_resume_ranks import _run  # noqa: E402
from tests.unit.test_megatron_layout import SHAPES, _hf  # noqa: E402

STEPS, K = 4, 2  # 3 steps compared, a 4th for the resume; checkpoint after step K
TOL = 1e-5
KEYS = ("train/loss", "train/grad_norm", "train/clip_frac", "train/approx_kl", "train/num_tokens")


def _base() -> Config:
    return _cfg(micro_batch_tokens=40, minibatches=2)


def _mega(world: int, tp: int) -> Config:
    cfg = _base()
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, backend="megatron", world_size=world,
                                                                tensor_parallel=tp))


def _train(trainer, rank: int, steps: range, out: dict, ckpt: Path | None = None) -> None:
    for s in steps:
        if ckpt is not None and s == K:
            trainer.save_checkpoint(str(ckpt), K, {"policy_version": trainer.policy_version,
                                                   "rng": trainer.rng_state()})
            out["weights_k"] = trainer.state_dict()
        if s == 3:
            out["weights_3"] = trainer.state_dict()
        out.setdefault("stats", []).append(step(trainer, rank, _groups(s)))
    out["weights_end"] = trainer.state_dict()
    source = trainer.weights()  # what a publish reads: gathered tensor by tensor, HF names, tied head an alias
    out["published_end"] = {n: source.get(n).clone() for n in source.names} if rank == 0 else {}
    out["published_aliases"] = dict(source.aliases)
    source.close()


def _logprob_errors() -> dict:
    """|HF - GPTModel| log-probs through the right layout and a wrong one, and the round trip (TP=1)."""
    from async_rl.trainer.backends.megatron_model import MegatronPolicy, build_gpt
    from async_rl.trainer.logprobs import token_logprobs

    result = {}
    for case in SHAPES:
        hf = _hf(case)
        shape, sd = LlamaShape.from_hf(hf.config), hf.state_dict()
        ids = torch.randint(0, 36, (3, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, 7:], ids[1, 7:] = 0, 0  # right-padded, as collate makes them
        want = token_logprobs(hf, ids, mask, 1.0)
        for layout in ("right", "wrong"):
            gpt = build_gpt(shape, 1, False, torch.device("cpu"))
            named = dict(gpt.named_parameters())
            for p in params(shape):
                shard = to_shard(p, sd.__getitem__, 0, 1, shape)
                if layout == "wrong" and p.kind == "qkv":
                    assert torch.equal(shard, interleave_qkv(*(sd[n] for n in p.hf), shape))
                    shard = torch.cat([sd[n] for n in p.hf])
                named[p.name].data.copy_(shard)
            with torch.no_grad():
                got = MegatronPolicy(gpt, 1.0).eval()(ids, mask, mask[:, 1:])
            result[case, layout] = float((got - want).abs().max())
            if layout == "right":
                back = {n: t for p in params(shape) for n, t in to_hf(p, [named[p.name].detach()], shape)}
                result[case, "exact"] = all(torch.equal(back[n], sd[n]) for n in back) and len(back) >= len(sd) - 1
    return result


def _two_ranks(rank: int, port: int, out: str, errors) -> None:
    """TP=1 x DP=2: 3 steps (rank 0 first checks GPTModel against HF); then TP=2: 4 steps with a
    checkpoint after step 2, and a resume from it."""
    try:
        torch.set_num_threads(1)
        out_dir, build = Path(out), get_backend("megatron").build
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
        info = RankInfo(rank, 2, store, timeout_s=120)
        dp: dict = {}
        trainer = build(_mega(2, 1), info)
        if rank == 0:
            torch.save(_logprob_errors(), out_dir / "layout.pt")
        torch.distributed.barrier()
        _train(trainer, rank, range(3), dp)
        full: dict = {}
        _train(build(_mega(2, 2), info), rank, range(STEPS), full, ckpt=out_dir / "ckpt")
        resumed = build(_mega(2, 2), info)
        meta = resumed.load_checkpoint(str(out_dir / "ckpt"))
        again: dict = {"meta": meta, "version": resumed.policy_version}
        _train(resumed, rank, range(K, STEPS), again)
        torch.save({"tp2": full, "resumed": again, "dp2": dp}, out_dir / f"rank{rank}.pt")
        resumed.close()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    port = free_port()
    _run([(_two_ranks, (0, port)), (_two_ranks, (1, port))], out)
    return out


def _same(got: dict, want_stats: list[dict], want_weights: dict[str, torch.Tensor], tol: float = TOL) -> None:
    for s, (ref, ours) in enumerate(zip(want_stats, got["stats"][:3])):
        for key in KEYS:
            assert abs(ref[key] - ours[key]) <= tol, (s, key, ref[key], ours[key])
    weights = got.get("weights_3", got["weights_end"])
    assert list(weights) == list(want_weights)  # HF names, HF order
    for name, ref in want_weights.items():
        assert torch.allclose(weights[name], ref, atol=tol, rtol=0), (name, (weights[name] - ref).abs().max())


def test_gpt_model_gives_hf_logprobs_and_a_wrong_layout_does_not(runs):
    result = torch.load(runs / "layout.pt")
    for case in SHAPES:
        assert result[case, "right"] <= 1e-5, result
        assert result[case, "exact"], case
        assert result[case, "wrong"] > 0.1, result  # the control: a layout mistake shows


def test_megatron_tp1_equals_single(runs):
    ref_stats, ref_weights, _ = _reference(_base())
    got = torch.load(runs / "rank0.pt", weights_only=False)["dp2"]
    _same(got, ref_stats, ref_weights)
    w = got["weights_end"]
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]  # tied: one tensor, as the single backend's


def test_megatron_tp2_equals_tp1(runs):
    r0 = torch.load(runs / "rank0.pt", weights_only=False)
    _same(r0["tp2"], r0["dp2"]["stats"], r0["dp2"]["weights_end"])
    r1 = torch.load(runs / "rank1.pt", weights_only=False)["tp2"]
    assert r1["weights_end"] == {}  # full weights come to rank 0 only
    published, want = r0["tp2"]["published_end"], r0["tp2"]["weights_end"]
    assert r0["tp2"]["published_aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert list(published) == [n for n in want if n != "lm_head.weight"]
    assert all(torch.equal(published[n], want[n]) for n in published)
    assert [s["train/loss"] for s in r1["stats"]] == [s["train/loss"] for s in r0["tp2"]["stats"]]


def test_resumed_tp2_run_repeats_the_uninterrupted_losses(runs):
    for rank in (0, 1):
        got = torch.load(runs / f"rank{rank}.pt", weights_only=False)
        full, again = got["tp2"], got["resumed"]
        assert again["meta"]["step"] == K and again["version"] == K
        want = [s["train/loss"] for s in full["stats"][K:]]
        assert len(again["stats"]) == len(want) == STEPS - K
        assert all(abs(a["train/loss"] - b) <= 1e-6 for a, b in zip(again["stats"], want)), (again["stats"], want)
        for name, w in full["weights_end"].items():
            assert torch.allclose(again["weights_end"][name], w, atol=1e-6, rtol=0), name


def test_checkpoint_is_a_plain_hf_model(runs):
    from transformers import AutoModelForCausalLM

    want = torch.load(runs / "rank0.pt", weights_only=False)["tp2"]["weights_k"]
    model = AutoModelForCausalLM.from_pretrained(str(runs / "ckpt"))
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
