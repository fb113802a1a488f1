"""Packed micro-batches (`trainer.pack_sequences`): one row of several trajectories, position ids
restarting at 0 for each, attention block-diagonal. Only the layout changes: log-probs, the loss
and its gradient must equal the padded layout's, on rows of different lengths, and each control
(positions that do not restart, a 2-D mask that lets the sequences see each other) must break
that by far more than float noise. Also: token-budget cuts, and the probe that keeps a model
which cannot pack on padded rows.
"""

import pytest
import torch

from async_rl.config import TrainerConfig
from async_rl.trainer.batching import collate, micro_batches, seq_len
from async_rl.trainer.logprobs import token_logprobs
from async_rl.trainer.trainer import PPOTrainer
from tests.unit.test_trainer import _one_thread, tok  # noqa: F401  (fixtures: pytest finds them here)
from tests.unit.test_trainer import _ids, _manual_logprobs, _model, _traj, recorded_grads

NOISE = 1e-5  # fp32: packed vs padded differ by summation order only
LEAK = 1e-2  # a control must miss by more than this (measured: ~0.2 on the tiny model)


def _groups(tok, model, version=0):
    """Two prompts x 3 answers of 1 to 9 tokens, one with a tool token (mask 0) in the middle."""
    groups = []
    for prompt, answers in (("1+2=", ("3", "3 1+1=2", "12 ")), ("13+20=", ("33", "7", "33 0+0=0"))):
        p = _ids(tok, prompt)
        group = []
        for k, a in enumerate(answers):
            r = _ids(tok, a)
            mask = [0 if j == 2 else 1 for j in range(len(r))] if len(r) > 3 else None
            group.append(_traj(model, p, r, reward=float(k % 2), group=prompt, version=version, mask=mask))
        groups.append(group)
    return groups


# ---------------------------------------------------------------------------------------- layout
def test_packed_collate_is_the_padded_rows_back_to_back(tok):
    model = _model(tok)
    trajs = [t for g in _groups(tok, model) for t in g]
    adv = torch.linspace(-1, 1, len(trajs))
    index = [4, 0, 2, 5]
    agg = lambda m: m / (1 + m.sum(dim=1, keepdim=True))  # noqa: E731 -- a per-trajectory weight rule
    padded = collate(trajs, adv, index, loss_agg=agg)
    packed = collate(trajs, adv, index, packed=True, loss_agg=agg)
    lengths = [seq_len(trajs[i]) for i in index]
    assert packed.batch_size == torch.Size([1]) and packed.input_ids.shape == (1, sum(lengths))
    assert packed.attention_mask.all() and packed.loss_mask.shape == (1, sum(lengths) - 1)
    start = 0
    for b, n in enumerate(lengths):
        assert torch.equal(packed.input_ids[0, start:start + n], padded.input_ids[b, :n])
        assert packed.position_ids[0, start:start + n].tolist() == list(range(n))
        for key in ("loss_mask", "behav_logprobs", "versions", "advantages", "loss_weights"):
            assert torch.equal(packed.get(key)[0, start:start + n - 1], padded.get(key)[b, :n - 1]), key
        if start + n - 1 < sum(lengths) - 1:  # the boundary column predicts the next trajectory's first token
            assert packed.loss_mask[0, start + n - 1] == 0 and packed.versions[0, start + n - 1] == -1
        start += n
    assert packed.num_tokens == padded.num_tokens


def test_packed_micro_batches_fill_a_token_budget(tok):
    model = _model(tok)
    lengths = [8] * 30 + [70] * 2  # the long tail that padded cuts must cut around
    trajs = [_traj(model, [3], [4] * (n - 1), reward=0.0, group="g") for n in lengths]
    assert micro_batches(trajs, token_budget=8192, overhead_tokens=256, packed=True) == [[30, 31] + list(range(30))]
    parts = micro_batches(trajs, token_budget=100, packed=True)
    assert sorted(i for p in parts for i in p) == list(range(32))
    assert all(sum(lengths[i] for i in p) <= 100 for p in parts)
    assert len(parts) == 4  # 380 tokens: first-fit reaches the bound ceil(380 / 100)
    assert micro_batches(trajs, token_budget=50, packed=True)[:2] == [[30], [31]]  # longer than the budget: alone


# ---------------------------------------------------------------------------------------- log-probs
def _pack(seqs):
    ids = torch.tensor([sum(seqs, [])])
    return ids, torch.tensor([[i for s in seqs for i in range(len(s))]])


def _unpack(row, seqs):
    """Each sequence's own columns of a packed [T-1] row."""
    out, start = [], 0
    for s in seqs:
        out.append(row[start:start + len(s) - 1])
        start += len(s)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_match_each_row_scored_alone_and_the_controls_do_not(tok, attn):
    model = _model(tok)
    model.config._attn_implementation = attn
    seqs = [_ids(tok, s) for s in ("1+2=3", "12+30=42 ", "7=", "4+4=8 8+1=9")]
    ids, positions = _pack(seqs)
    with torch.no_grad():
        packed = token_logprobs(model, ids, None, 0.7, position_ids=positions, chunk_tokens=5)[0]
        running = token_logprobs(model, ids, None, 0.7, position_ids=torch.arange(ids.shape[1])[None])[0]
        seen = token_logprobs(model, ids, torch.ones_like(ids), 0.7, position_ids=positions)[0]
    alone = [_manual_logprobs(model, s, 0.7) for s in seqs]
    gap = lambda lp: max(float((a - b).abs().max()) for a, b in zip(_unpack(lp, seqs), alone))  # noqa: E731
    assert gap(packed) <= NOISE
    # controls: positions that run on across sequences, or a 2-D mask (a plain causal row: no block diagonal)
    assert gap(running) > LEAK and gap(seen) > LEAK
    boundary = torch.tensor([sum(map(len, seqs[:k + 1])) - 1 for k in range(len(seqs) - 1)])
    assert (packed[boundary] == 0).all()  # never scored: the next sequence's first token


def test_packed_sdpa_attends_sequence_by_sequence_and_restores_the_config(tok, monkeypatch):
    """An sdpa model's packed row runs one causal attention per sequence per layer (sum of n^2 scores, no
    [T, T] mask), and the model's attention setting is back to sdpa after the call (checkpoints save it)."""
    from transformers.integrations import sdpa_attention

    model = _model(tok)
    assert model.config._attn_implementation == "sdpa"
    seqs = [_ids(tok, s) for s in ("1+2=3", "12+30=42 ", "7=")]
    ids, positions = _pack(seqs)
    calls, forward = [], sdpa_attention.sdpa_attention_forward

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], attention_mask))
        return forward(module, query, key, value, attention_mask, **kwargs)
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", counted)
    with torch.no_grad():
        token_logprobs(model, ids, None, 1.0, position_ids=positions)
    assert calls == [(len(s), None) for _ in range(model.config.num_hidden_layers) for s in seqs]
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------- the update
def _step(tok, packed, *, layout=None, **cfg):
    model = _model(tok)
    trainer = PPOTrainer(model, TrainerConfig(compute_dtype="float32", lr=1e-3, pack_sequences=packed, **cfg),
                         temperature=1.0, max_staleness=0, seed=0)
    if layout is not None:
        trainer._layout = layout
    grads = recorded_grads(trainer)
    stats = trainer.train_step(_groups(tok, model))
    return stats, grads


@pytest.mark.parametrize("cfg", [dict(micro_batch_tokens=4096), dict(micro_batch_tokens=24, minibatches=2),
                                 dict(micro_batch_tokens=30, loss_agg="seq_mean_token_mean")])
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(tok, cfg):
    (padded, g_pad), (packed, g_pack) = _step(tok, False, **cfg), _step(tok, True, **cfg)
    assert packed["train/num_tokens"] == padded["train/num_tokens"] > 0
    for key in ("train/loss", "train/grad_norm", "train/clip_frac", "train/approx_kl", "train/logprob_mismatch_max"):
        assert packed[key] == pytest.approx(padded[key], abs=NOISE), key
    assert len(g_pack) == len(g_pad) == cfg.get("minibatches", 1)
    for a, b in zip(g_pack, g_pad):
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= NOISE

    def running(batch):  # the control: packed rows whose positions do not restart
        return None, torch.arange(batch.input_ids.shape[1])[None]
    _, g_bad = _step(tok, True, layout=running, **cfg)
    assert max(float((a[k] - b[k]).abs().max()) for a, b in zip(g_bad, g_pad) for k in a) > 100 * NOISE


# ---------------------------------------------------------------------------------------- the probe
def _leaky(tok):
    """A tiny Llama (eager attention: transformers' own mask) whose decoder drops position ids: packed
    sequences then see each other."""
    model = _model(tok)
    model.config._attn_implementation = "eager"
    forward = model.model.forward
    model.model.forward = lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)
    return model


def test_a_model_that_cannot_pack_trains_padded_or_is_refused(tok, caplog):
    def make(model, setting):
        return PPOTrainer(model, TrainerConfig(compute_dtype="float32", pack_sequences=setting), temperature=1.0,
                          max_staleness=0, seed=0)
    assert make(_model(tok), None).packed and make(_model(tok), True).packed
    assert not make(_model(tok), False).packed
    assert not make(_leaky(tok), None).packed
    assert "training padded rows" in caplog.text
    with pytest.raises(ValueError, match=r"^trainer.pack_sequences: .* set trainer.pack_sequences=false"):
        make(_leaky(tok), True)
