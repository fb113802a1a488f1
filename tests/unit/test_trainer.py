"""Batching, token log-probs, the PPO trainer and checkpoints, on a tiny random Llama built in-process.

Trajectories are synthetic but their behaviour log-probs come from a real forward pass
of the model, as the engine would report them.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from async_rl.config import ModelConfig, TrainerConfig
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.trainer.batching import collate, micro_batches
from async_rl.trainer.logprobs import token_logprobs
from async_rl.trainer.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from async_rl.trainer.trainer import PPOTrainer
from async_rl.types import Trajectory

ALPHABET = "0123456789+= "


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(ALPHABET)


def _model(tok, seed=0):
    return load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=seed, tokenizer=tok)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _manual_logprobs(model, ids, temperature):
    """Per-sequence HF forward, no padding: [len(ids) - 1]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _traj(model, prompt, response, *, reward, group, version=0, mask=None, interruptions=0, temperature=1.0):
    """A trajectory whose behav_logprobs are the model's own log-probs of the response."""
    full = _manual_logprobs(model, prompt + response, temperature)[len(prompt) - 1:].numpy()
    mask = np.ones(len(response), np.uint8) if mask is None else np.asarray(mask, np.uint8)
    versions = np.atleast_1d(np.asarray(version, np.int32))
    versions = np.broadcast_to(versions, (len(response),)).copy() if len(versions) == 1 else versions
    return Trajectory(id=f"{group}-{reward}-{len(response)}-{np.random.randint(1 << 30)}", group_id=group,
                      prompt_ids=np.asarray(prompt, np.int32), response_ids=np.asarray(response, np.int32),
                      loss_mask=mask, behav_logprobs=np.where(mask, full, 0.0).astype(np.float32),
                      versions=np.where(mask, versions, -1).astype(np.int32), reward=reward,
                      finish_reason="stop", num_interruptions=interruptions)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_match_per_sequence_forward_despite_padding(tok, temperature):
    model = _model(tok)
    seqs = [_ids(tok, s) for s in ("1+2=3", "12+30=42 ", "7=")]
    L = max(map(len, seqs))
    input_ids = torch.zeros(len(seqs), L, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for b, s in enumerate(seqs):
        input_ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
    with torch.no_grad():
        out = token_logprobs(model, input_ids, attn, temperature)
        chunked = token_logprobs(model, input_ids, attn, temperature, chunk_tokens=3)
    assert out.shape == (3, L - 1) and out.dtype == torch.float32
    for b, s in enumerate(seqs):
        assert torch.allclose(out[b, :len(s) - 1], _manual_logprobs(model, s, temperature), atol=1e-5)
        assert (out[b, len(s) - 1:] == 0).all()
    assert torch.allclose(chunked, out, atol=1e-6)


def test_token_logprobs_gradient_matches_full_logits(tok):
    model = _model(tok)
    ids = torch.tensor([_ids(tok, "3+4=7  "), _ids(tok, "9+0=9 1")])
    attn = torch.ones_like(ids)
    score = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 1, 1]])
    token_logprobs(model, ids, attn, 0.8, score_mask=score, chunk_tokens=2).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1] / 0.8
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref * score).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-5), n


def test_collate_places_response_tokens_and_masks_tool_tokens(tok):
    model = _model(tok)
    a = _traj(model, [3, 4], [5, 6, 7], reward=1.0, group="g", version=[2, 3, 0], mask=[1, 1, 0])
    b = _traj(model, [3, 4, 8, 9], [10], reward=0.0, group="g", version=4)
    batch = collate([a, b], torch.tensor([0.5, -0.5]), [0, 1])
    assert batch.input_ids.tolist() == [[3, 4, 5, 6, 7], [3, 4, 8, 9, 10]]
    assert batch.attention_mask.tolist() == [[1] * 5, [1] * 5]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    assert batch.versions.tolist() == [[-1, 2, 3, -1], [-1, -1, -1, 4]]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0], [0, 0, 0, -0.5]]
    assert torch.allclose(batch.behav_logprobs[0, 1:3], torch.from_numpy(a.behav_logprobs[:2]))
    assert batch.num_tokens == 3
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, score_mask=batch.loss_mask)
    assert torch.allclose(lp, batch.behav_logprobs, atol=1e-5)  # behav came from the same weights


def test_micro_batches_cover_everything_within_budget(tok):
    model = _model(tok)
    trajs = [_traj(model, [3] * p, [4] * r, reward=0.0, group="g") for p, r in [(2, 9), (1, 1), (5, 5), (3, 2), (1, 20)]]
    parts = micro_batches(trajs, token_budget=12)
    assert sorted(i for part in parts for i in part) == list(range(5))
    for part in parts:
        longest = max(len(trajs[i].prompt_ids) + len(trajs[i].response_ids) for i in part)
        assert len(part) * longest <= 12 or len(part) == 1
    assert [4] in parts  # longer than the budget: alone


def test_a_long_tail_is_cut_off_where_that_saves_padding(tok):
    model = _model(tok)
    lengths = [8] * 30 + [70] * 2  # a typical batch of sampled lengths: most end early, a few run long
    trajs = [_traj(model, [3], [4] * (n - 1), reward=0.0, group="g") for n in lengths]
    padded = lambda parts: sum(len(p) * max(lengths[i] for i in p) for p in parts)  # noqa: E731
    one = micro_batches(trajs, token_budget=8192, overhead_tokens=10_000)  # one more pass costs more than any padding
    assert len(one) == 1 and padded(one) == 32 * 70
    two = micro_batches(trajs, token_budget=8192, overhead_tokens=256)
    assert sorted(map(sorted, two)) == [list(range(30)), [30, 31]] and padded(two) == 30 * 8 + 2 * 70
    # within a budget the cut also respects it, and nothing is lost or repeated
    tight = micro_batches(trajs, token_budget=100, overhead_tokens=256)
    assert sorted(i for p in tight for i in p) == list(range(32))
    assert all(len(p) * max(lengths[i] for i in p) <= 100 for p in tight)
    with pytest.raises(ValueError, match="micro_batch_overhead_tokens"):
        micro_batches(trajs, token_budget=100, overhead_tokens=-1)


# ---------------------------------------------------------------------------------------- trainer
def _good_bad_groups(tok, model, version):
    """Two prompts, each with two rewarded and two unrewarded answers, sampled at `version`."""
    groups = []
    for prompt, good, bad in (("1+2=", "3", "7"), ("2+2=", "4", "9")):
        p = _ids(tok, prompt)
        groups.append([_traj(model, p, _ids(tok, ans), reward=r, group=prompt, version=version)
                       for ans, r in ((good, 1.0), (bad, 0.0), (good, 1.0), (bad, 0.0))])
    return groups


def _answer_logprob(model, tok, prompt, answer):
    ids = _ids(tok, prompt + answer)
    return float(_manual_logprobs(model, ids, 1.0)[len(_ids(tok, prompt)) - 1:].sum())


def test_training_steps_raise_high_reward_answers(tok):
    model = _model(tok)
    before = _params(model)
    good0, bad0 = _answer_logprob(model, tok, "1+2=", "3"), _answer_logprob(model, tok, "1+2=", "7")
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-2, minibatches=2), temperature=1.0, max_staleness=1, seed=0)
    for step in range(4):
        stats = trainer.train_step(_good_bad_groups(tok, model, version=trainer.policy_version))
        assert stats["train/num_trajectories"] == 8 and stats["train/dropped_stale"] == 0
        assert stats["train/optimizer_steps"] == 2 and np.isfinite(stats["train/loss"])
    assert trainer.policy_version == 4 and not model.training
    after = _params(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert _answer_logprob(model, tok, "1+2=", "3") > good0 + 0.5
    assert _answer_logprob(model, tok, "1+2=", "7") < bad0 - 0.5
    assert stats["train/reward_mean"] == 0.5 and stats["train/reward_std"] == 0.5
    assert stats["train/num_tokens"] == 8 and stats["train/response_len_mean"] == 1.0
    keys = ("train/loss train/staleness_max train/staleness_mean train/grad_norm train/clip_frac "
            "train/behav_weight_mean rollout/interrupted timing/train_s").split()
    assert all(k in stats for k in keys)


def test_stale_trajectories_are_dropped_and_staleness_measured(tok):
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=2, seed=0, policy_version=5)
    p = _ids(tok, "1+1=")
    groups = [[_traj(model, p, [5, 6, 7], reward=1.0, group="a", version=[3, 4, 5], interruptions=2),
               _traj(model, p, [5, 6], reward=0.0, group="a", version=[2, 5], interruptions=1),  # 2 < 5-2
               _traj(model, p, [8, 9, 4], reward=0.0, group="a", version=[5, 1, 5], mask=[1, 0, 1])],
              [_traj(model, p, [9], reward=1.0, group="b", version=1),  # too old
               _traj(model, p, [4], reward=0.0, group="b", version=4)]]
    stats = trainer.train_step(groups)
    assert stats["train/dropped_stale"] == 2 and stats["train/num_trajectories"] == 3
    assert stats["rollout/interrupted"] == 2
    assert stats["train/staleness_max"] == 2  # token of version 3; the masked tool token (version -1) ignored
    assert stats["train/staleness_mean"] == pytest.approx((2 + 1 + 0 + 0 + 0 + 1) / 6)
    assert stats["train/num_tokens"] == 6 and trainer.policy_version == 6
    # oldest sampled-token lags of the arriving trajectories: 2, 3 (too old), 0, 4 (too old), 1 -> bins 0..2, >2
    assert stats["train/staleness_hist"] == [1, 1, 1, 2]
    assert stats["train/versions_per_traj_mean"] == pytest.approx((3 + 2 + 1 + 1 + 1) / 5)
    assert stats["train/versions_per_traj_max"] == 3


def test_stale_tokens_mask_trains_the_tokens_within_the_bound_and_no_older_one(tok, monkeypatch):
    """trainer.stale_tokens=mask: a trajectory that ran past the bound keeps its tokens sampled within
    it (the older ones stay as context, out of the loss); one with none within it is still dropped.
    The guarantee is per trained token: with the masking broken, the staleness check sees it."""
    model = _model(tok)
    p = _ids(tok, "1+1=")

    def groups():
        return [[_traj(model, p, [5, 6, 7, 8], reward=1.0, group="a", version=[1, 2, 3, 4], interruptions=3),
                 _traj(model, p, [5, 6], reward=0.0, group="a", version=[1, 2]),  # every token too old
                 _traj(model, p, [8, 9], reward=0.0, group="a", version=[4, 5])]]

    def step(stale_tokens):
        trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", stale_tokens=stale_tokens),
                             temperature=1.0, max_staleness=2, seed=0, policy_version=5)
        return trainer.train_step(groups())

    drop = step("drop")
    assert drop["train/num_trajectories"] == 1 and drop["train/dropped_stale"] == 2
    assert drop["train/stale_masked_trajs"] == 0 and drop["train/num_tokens"] == 2
    mask = step("mask")
    assert mask["train/num_trajectories"] == 2 and mask["train/dropped_stale"] == 1
    assert mask["train/stale_masked_trajs"] == 1 and mask["train/stale_masked_tokens"] == 2  # versions 1, 2 < 5-2
    assert mask["train/num_tokens"] == 4 and mask["train/staleness_max"] == 2  # tokens of versions 3, 4, 4, 5
    # the arrival histogram still shows what came in over the bound (oldest lags 4, 4, 1)
    assert mask["train/staleness_hist"] == [0, 1, 0, 2]
    masked = groups()[0][0].within_bound(3)
    assert masked.loss_mask.tolist() == [0, 0, 1, 1] and masked.oldest_version() == 3
    assert masked.response_ids.tolist() == [5, 6, 7, 8]  # still there, as context
    monkeypatch.setattr(Trajectory, "within_bound", lambda self, floor: self)  # masking broken on purpose
    assert step("mask")["train/staleness_max"] == 4


def test_stale_tokens_mask_needs_generations_that_run_past_the_bound():
    from async_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.restart_stale=false"):
        load_config(None, ["trainer.stale_tokens=mask"])
    with pytest.raises(ConfigError, match="trainer.stale_tokens: must be one of drop|mask"):
        load_config(None, ["trainer.stale_tokens=keep"])
    assert load_config(None, ["trainer.stale_tokens=mask", "rollout.restart_stale=false"]).trainer.stale_tokens == "mask"


@pytest.mark.parametrize("minibatches", [1, 2])  # prox from the training forward, or recomputed first
def test_logprob_mismatch_is_measured_on_the_trainers_own_version(tok, minibatches):
    """Behaviour log-probs = the model's own plus known offsets: the metric reports exactly those
    offsets for tokens of the trainer's version, and ignores an older token's (staleness)."""
    model = _model(tok)
    cfg = TrainerConfig(compute_dtype="float32", minibatches=minibatches)
    trainer = PPOTrainer(model, cfg, temperature=1.0, max_staleness=1, seed=0, policy_version=4)
    p = _ids(tok, "1+1=")
    trajs = [_traj(model, p, [5, 6], reward=1.0, group="a", version=4),
             _traj(model, p, [7], reward=0.0, group="a", version=4),
             _traj(model, p, [8], reward=1.0, group="b", version=3),
             _traj(model, p, [9], reward=0.0, group="b", version=4)]
    for t, offset in zip(trajs, ([0.1, -0.3], [0.0], [5.0], [0.2])):
        t.behav_logprobs[:] += np.asarray(offset, np.float32)  # the engine's log-probs, off by `offset`
    stats = trainer.train_step([trajs[:2], trajs[2:]])
    d = [-0.1, 0.3, 0.0, -0.2]  # log(pi_trainer / pi_engine) of the four version-4 tokens
    assert stats["train/logprob_mismatch_mean"] == pytest.approx(0.6 / 4, abs=1e-5)
    assert stats["train/logprob_mismatch_max"] == pytest.approx(0.3, abs=1e-5)
    assert stats["train/logprob_mismatch_kl"] == pytest.approx(sum(np.exp(x) - 1 - x for x in d) / 4, abs=1e-5)
    assert stats["train/logprob_mismatch_frac"] == pytest.approx(4 / 5)


def test_kl_reference_is_the_initial_weights_frozen_and_off_by_default(tok, tmp_path):
    from async_rl.trainer.backends.single import SingleTrainer

    assert PPOTrainer(_model(tok), TrainerConfig(), temperature=1.0, max_staleness=0, seed=0).ref_model is None
    model = _model(tok)
    initial = _params(model)
    cfg = TrainerConfig(compute_dtype="float32", lr=1e-2, kl_coef=0.5)
    trainer = SingleTrainer(model, cfg, temperature=1.0, max_staleness=0, seed=0)
    first = trainer.train_step(_good_bad_groups(tok, model, version=0))
    assert first["train/ref_kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is the reference before any update
    for _ in range(2):
        stats = trainer.train_step(_good_bad_groups(tok, model, version=trainer.policy_version))
    assert stats["train/ref_kl"] > 1e-4  # the policy moved away from it, and the loss pays kl_coef for that
    ref = trainer.ref_model.state_dict()
    assert all(torch.equal(ref[k], initial[k]) for k in initial)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    # a resumed trainer starts from the initial weights and loads the checkpoint into its policy only
    trainer.save_checkpoint(str(tmp_path / "ckpt"), 3, {"policy_version": 3})
    resumed = SingleTrainer(_model(tok), cfg, temperature=1.0, max_staleness=0, seed=0)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(resumed.ref_model.state_dict()[k], initial[k]) for k in initial)
    assert not torch.equal(resumed.model.state_dict()["lm_head.weight"], initial["lm_head.weight"])


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_sharded_backends_refuse_a_kl_term_they_cannot_compute(backend):
    from async_rl.config import Config
    from async_rl.trainer.backends import get_backend

    pytest.importorskip("megatron.core") if backend == "megatron" else None
    cfg = Config(trainer=TrainerConfig(backend=backend, world_size=1, kl_coef=0.1))
    with pytest.raises(ValueError, match="trainer.kl_coef"):
        get_backend(backend).check(cfg)


def test_kl_pulls_the_policy_back_toward_the_reference(tok):
    """Zero advantages (every reward equal), a policy perturbed away from the reference: with the KL
    term its answers' log-probs move back toward the reference's; without it nothing moves."""
    answers = [(p, a) for p, good, bad in (("1+2=", "3", "7"), ("2+2=", "4", "9")) for a in (good, bad)]

    def gap_before_after(kl_coef):
        torch.manual_seed(0)
        model = _model(tok)
        reference = copy.deepcopy(model)
        trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-3, kl_coef=kl_coef), temperature=1.0,
                             max_staleness=0, seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))

        def gap():
            return sum(abs(_answer_logprob(model, tok, p, a) - _answer_logprob(reference, tok, p, a)) for p, a in answers)

        before = gap()
        for _ in range(3):
            groups = _good_bad_groups(tok, model, version=trainer.policy_version)
            trainer.train_step([[dataclasses.replace(t, reward=1.0) for t in g] for g in groups])
        return before, gap()

    before, after = gap_before_after(1.0)
    assert after < 0.9 * before
    before, after = gap_before_after(0.0)
    assert after == pytest.approx(before, rel=1e-6)


def test_all_stale_is_not_a_train_step_but_is_reported(tok):
    model = _model(tok)
    before = _params(model)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=0, seed=0, policy_version=3)
    stats = trainer.train_step(_good_bad_groups(tok, model, version=2))
    assert stats["train/dropped_stale"] == 8 and stats["train/num_trajectories"] == 0
    assert stats["train/optimizer_steps"] == 0 and stats["train/reward_mean"] == 0.5
    assert all(torch.equal(before[k], v) for k, v in _params(model).items())
    # not a train step: the version stays, so a side that fell behind cannot spin the trainer through versions
    assert trainer.policy_version == 3 and stats["train/skipped_batch"] == 1.0


def recorded_grads(trainer) -> list[dict[str, torch.Tensor]]:
    """The gradient each optimizer step of `trainer` applies (filled as it steps)."""
    steps, step = [], trainer.optimizer.step

    def recording(*args, **kwargs):
        steps.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)
    trainer.optimizer.step = recording
    return steps


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batching_does_not_change_the_update(tok, loss_agg, packed):
    results = []
    for budget in (4096, 6):  # one micro-batch, or one trajectory each
        model = _model(tok)
        cfg = TrainerConfig(compute_dtype="float32", lr=1e-2, micro_batch_tokens=budget, loss_agg=loss_agg,
                            loss_agg_tokens=4, pack_sequences=packed)
        trainer = PPOTrainer(model, cfg, temperature=1.0, max_staleness=0, seed=0)
        grads = recorded_grads(trainer)
        groups = _good_bad_groups(tok, model, version=0)
        groups[0][0] = _traj(model, _ids(tok, "1+2="), _ids(tok, "3 5"), reward=1.0, group="1+2=")
        stats = trainer.train_step(groups)
        results.append((grads[0], stats["train/loss"], stats["train/grad_norm"]))
    (p1, l1, g1), (p2, l2, g2) = results
    # the accumulated gradient is the same, up to float summation order (compared before Adam, whose
    # first step divides by |g| and so turns the noise of a near-zero gradient into a step of lr)
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    assert all(torch.allclose(p1[k], p2[k], rtol=1e-4, atol=1e-7) for k in p1)


def test_same_seed_same_result(tok):
    out = []
    for _ in range(2):
        model = _model(tok)
        trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-2, minibatches=3), temperature=1.0, max_staleness=1, seed=7)
        np.random.seed(0)
        for _ in range(2):
            trainer.train_step(_good_bad_groups(tok, model, version=trainer.policy_version))
        out.append(_params(model))
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])


def test_state_dict_is_a_detached_cpu_snapshot(tok):
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32"), temperature=1.0, max_staleness=0, seed=0)
    snap = trainer.state_dict()
    assert list(snap) == list(model.state_dict())
    assert all(t.device.type == "cpu" and not t.requires_grad for t in snap.values())
    assert snap["lm_head.weight"] is snap["model.embed_tokens.weight"]  # tied in the model, tied here
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(snap["model.embed_tokens.weight"], model.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_latest(tok, tmp_path):
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-2), temperature=1.0, max_staleness=0, seed=0)
    trainer.train_step(_good_bad_groups(tok, model, version=0))
    save_checkpoint(checkpoint_dir(tmp_path, 1), model, trainer.optimizer, 1, {"policy_version": 1})
    out = save_checkpoint(checkpoint_dir(tmp_path, 12), model, trainer.optimizer, 12, {"policy_version": 12})
    (tmp_path / "step_000099.tmp123").mkdir()  # an interrupted write is not a checkpoint
    assert latest_checkpoint(tmp_path) == out and latest_checkpoint(tmp_path / "none") is None

    fresh = _model(tok, seed=1)
    fresh_trainer = PPOTrainer(fresh, TrainerConfig(compute_dtype="float32", lr=1e-2), temperature=1.0, max_staleness=0, seed=0)
    meta = load_checkpoint(out, fresh, fresh_trainer.optimizer)
    assert meta == {"step": 12, "policy_version": 12}
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    s1, s2 = trainer.optimizer.state_dict(), fresh_trainer.optimizer.state_dict()
    for i, st in s1["state"].items():
        assert torch.equal(st["exp_avg"], s2["state"][i]["exp_avg"])
    save_checkpoint(out, fresh, None, 12, {"policy_version": 12})  # overwriting works, no optimizer
    with pytest.raises(FileNotFoundError, match="optimizer"):
        load_checkpoint(out, copy.deepcopy(fresh), fresh_trainer.optimizer)
    with pytest.raises(FileNotFoundError, match="meta.json"):
        load_checkpoint(tmp_path, fresh)


def test_the_lr_schedule_sets_each_steps_rate_and_a_decay_ends_at_zero(tok):
    """linear over 3 steps after 1 of warm-up: 1/2, 1, 1/2, 0, 0 of trainer.lr; at 0 the weights stay."""
    model = _model(tok)
    cfg = TrainerConfig(compute_dtype="float32", lr=1e-2, lr_schedule="linear", lr_warmup_steps=1, lr_decay_steps=3)
    trainer = PPOTrainer(model, cfg, temperature=1.0, max_staleness=1, seed=0)
    lrs = []
    for step in range(5):
        before = _params(model)
        lrs.append(trainer.train_step(_good_bad_groups(tok, model, version=trainer.policy_version))["train/lr"])
        moved = any(not torch.equal(before[k], v) for k, v in _params(model).items())
        assert moved == (lrs[-1] > 0), (step, lrs)
    assert lrs == pytest.approx([5e-3, 1e-2, 5e-3, 0.0, 0.0])
    with pytest.raises(ValueError, match="trainer.lr_schedule: unknown schedule 'step'"):
        PPOTrainer(model, dataclasses.replace(cfg, lr_schedule="step"), temperature=1.0, max_staleness=1, seed=0)
