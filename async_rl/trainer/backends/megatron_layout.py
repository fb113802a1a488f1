"""Hugging Face Llama <-> Megatron-core GPTModel: which tensor goes where, and how TP shards it.

    shape = LlamaShape.from_hf(hf_config)                     # ValueError for a family it cannot map
    for p in params(shape):                                   # Megatron's parameters, in HF state_dict order
        mine = to_shard(p, hf_state.__getitem__, tp_rank, tp_size)   # this rank's piece, one tensor at a time
        ...
        for name, t in to_hf(p, [shard_0, ..., shard_tp-1], shape):  # the gathered shards back to HF tensors
            ...

Pure tensor code (no megatron import), so the layout is tested without a process group.
The mapping for Llama-family models (RMSNorm, SwiGLU, RoPE, GQA, no biases), as checked
against megatron-core 0.16.1's `get_gpt_layer_local_spec`:

- `linear_qkv` is interleaved per query group g: [the q heads of group g; k_g; v_g], each
  head `head_dim` rows. TP splits it on dim 0, whole groups per rank, so a rank's shard is
  a contiguous block of the full interleaved tensor.
- `linear_fc1` is cat(gate, up); TP rank r holds [gate_r; up_r], so gathered shards are
  re-chunked into gate and up, not simply concatenated.
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) split on dim 1; the embedding and an
  untied `output_layer` split the vocabulary (dim 0); the norms are whole on every rank.
- The local spec keeps the norms as modules of their own; the Transformer Engine spec fuses
  them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (`te=True`).
- A tied model has no `output_layer`: the LM head is the embedding (`lm_head.weight` is
  yielded as the same tensor as `model.embed_tokens.weight`). No RoPE permutation: HF's
  rotate-half and Megatron's non-interleaved RoPE are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

MAPPABLE = ("llama",)  # HF model_type values with this layout (SmolLM2 is one)


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes the mapping depends on, read from an HF config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    eps: float
    rope_theta: float
    max_position: int

    @classmethod
    def from_hf(cls, config: Any) -> "LlamaShape":
        kind = getattr(config, "model_type", None)
        if kind not in MAPPABLE:
            raise ValueError(f"model.name: trainer.backend=megatron maps {'|'.join(MAPPABLE)} models only "
                             f"(Llama layout: RMSNorm, SwiGLU, RoPE, no biases), this one is {kind!r}")
        for attr in ("attention_bias", "mlp_bias"):
            if getattr(config, attr, False):
                raise ValueError(f"model.name: trainer.backend=megatron maps Llama models without biases, "
                                 f"this one has {attr}=True")
        scaling = getattr(config, "rope_scaling", None) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"model.name: trainer.backend=megatron maps plain RoPE only, this model has "
                             f"rope_scaling={scaling}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"model.name: trainer.backend=megatron maps SwiGLU (silu) MLPs only, this model "
                             f"has hidden_act={config.hidden_act!r}")
        heads = config.num_attention_heads
        theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)), eps=float(config.rms_norm_eps),
                   rope_theta=float(theta), max_position=config.max_position_embeddings)

    def check_tp(self, tp: int) -> None:
        """ValueError naming trainer.tensor_parallel when a size does not divide by it."""
        for what, n in (("attention heads", self.heads), ("key/value heads", self.kv_heads),
                        ("vocabulary size", self.vocab), ("MLP width", self.ffn)):
            if n % tp:
                raise ValueError(f"trainer.tensor_parallel: {tp} does not divide the model's {what} ({n}); "
                                 f"pick a divisor of {n}")


@dataclass(frozen=True, slots=True)
class Param:
    """One Megatron parameter and the HF tensors it is made of."""

    name: str  # Megatron's name (GPTModel.named_parameters())
    hf: tuple[str, ...]  # the HF names, in the order `to_hf` yields them
    kind: str  # "copy" | "qkv" | "fc1"
    tp_dim: int | None  # the dim TP splits, None where every rank holds it whole


def params(shape: LlamaShape, te: bool = False) -> list[Param]:
    """Megatron's parameters in the order their HF tensors come in HF's state_dict."""
    out = [Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", 0)]
    for i in range(shape.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv_norm = m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
        fc1_norm = m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")
        out += [Param(m + "self_attention.linear_qkv.weight",
                      tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv", 0),
                Param(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "copy", 1),
                Param(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1", 0),
                Param(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", 1),
                Param(qkv_norm, (h + "input_layernorm.weight",), "copy", None),
                Param(fc1_norm, (h + "post_attention_layernorm.weight",), "copy", None)]
    out.append(Param("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if not shape.tied:
        out.append(Param("output_layer.weight", ("lm_head.weight",), "copy", 0))
    return out


def hf_specs(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every distinct tensor `to_hf` yields, in order (a tied LM head is not one)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        h = f"model.layers.{i}."
        out += [(h + "self_attn.q_proj.weight", (q, shape.hidden)), (h + "self_attn.k_proj.weight", (kv, shape.hidden)),
                (h + "self_attn.v_proj.weight", (kv, shape.hidden)), (h + "self_attn.o_proj.weight", (shape.hidden, q)),
                (h + "mlp.gate_proj.weight", (shape.ffn, shape.hidden)), (h + "mlp.up_proj.weight", (shape.ffn, shape.hidden)),
                (h + "mlp.down_proj.weight", (shape.hidden, shape.ffn)), (h + "input_layernorm.weight", (shape.hidden,)),
                (h + "post_attention_layernorm.weight", (shape.hidden,))]
    out.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, shape.hidden)))
    return out


def _qkv_groups(qkv: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """[G * (qpg + 2) * head_dim, H] -> [G, qpg + 2, head_dim, H] (a view)."""
    qpg = shape.heads // shape.kv_heads
    return qkv.view(shape.kv_heads, qpg + 2, shape.head_dim, -1)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """HF q [heads*hd, H], k and v [kv_heads*hd, H] -> Megatron's linear_qkv, grouped per KV head."""
    g, hd, qpg = shape.kv_heads, shape.head_dim, shape.heads // shape.kv_heads
    return torch.cat([q.reshape(g, qpg, hd, -1), k.reshape(g, 1, hd, -1), v.reshape(g, 1, hd, -1)],
                     dim=1).reshape(g * (qpg + 2) * hd, -1)


def to_shard(p: Param, get: Callable[[str], torch.Tensor], tp_rank: int, tp_size: int,
             shape: LlamaShape) -> torch.Tensor:
    """TP rank `tp_rank`'s piece of Megatron parameter `p`, from HF tensors `get(name)` (a new tensor)."""
    if p.kind == "qkv":
        full = interleave_qkv(*(get(n) for n in p.hf), shape)
        return full.chunk(tp_size, dim=0)[tp_rank].clone()
    if p.kind == "fc1":
        gate, up = (get(n).chunk(tp_size, dim=0)[tp_rank] for n in p.hf)
        return torch.cat([gate, up])
    t = get(p.hf[0])
    return (t if p.tp_dim is None else t.chunk(tp_size, dim=p.tp_dim)[tp_rank]).clone()


def to_hf(p: Param, shards: list[torch.Tensor], shape: LlamaShape) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of Megatron parameter `p` from all TP ranks' shards (rank order)."""
    if p.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        yield p.hf[0], torch.cat([h[0] for h in halves])
        yield p.hf[1], torch.cat([h[1] for h in halves])
        return
    full = shards[0] if p.tp_dim is None else torch.cat(shards, dim=p.tp_dim)
    if p.kind == "qkv":
        groups = _qkv_groups(full, shape)
        qpg = shape.heads // shape.kv_heads
        yield p.hf[0], groups[:, :qpg].reshape(shape.heads * shape.head_dim, -1).clone()
        yield p.hf[1], groups[:, qpg].reshape(shape.kv_heads * shape.head_dim, -1).clone()
        yield p.hf[2], groups[:, qpg + 1].reshape(shape.kv_heads * shape.head_dim, -1).clone()
        return
    yield p.hf[0], full
