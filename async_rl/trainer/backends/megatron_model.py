"""A Megatron-core GPTModel of an HF Llama's shape, and its token log-probs (vocab-parallel under TP).

    gpt = build_gpt(shape, tp=2, te=False, device)             # after parallel_state is initialised
    policy = MegatronPolicy(gpt, temperature=1.0)
    logprobs = policy(input_ids, attention_mask, score_mask)   # [B, L-1], as logprobs.token_logprobs

The policy runs the embedding and the decoder, then applies the LM head only at the scored
positions, a chunk at a time (logprobs.chunked_logprobs): each tensor-parallel rank
multiplies by its vocabulary shard of the head and megatron's `vocab_parallel_cross_entropy`
combines the shards' max and sum-exp, so no rank ever holds a full-vocabulary row. The
hidden state enters the head through `copy_to_tensor_model_parallel_region` (identity
forward, all-reduce backward), so each rank's hidden gradient is the sum over all shards.

Padded rows (the default) need only a causal mask: rows are right-padded and megatron's RoPE
ignores position ids. Packed rows (`packed=True`, Transformer Engine on GPU) concatenate the
real tokens of every row into one THD sequence with cumulative lengths instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from async_rl.trainer.backends.megatron_cpu import causal_mask
from async_rl.trainer.backends.megatron_layout import LlamaShape
from async_rl.trainer.logprobs import chunked_logprobs


def build_gpt(shape: LlamaShape, tp: int, te: bool, device: torch.device) -> torch.nn.Module:
    """An uninitialised GPTModel of `shape` on `device` (fp32 master weights; the caller loads the HF weights)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        # fused kernels are CUDA (and the CPU RNG shim relies on dropout 0); the TE spec brings its own
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, sequence_parallel=False)
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.0  # megatron_cpu._CpuRngTracker
    spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec(normalization="RMSNorm")
    with torch.device(device):
        gpt = GPTModel(config, spec, vocab_size=shape.vocab, max_sequence_length=shape.max_position,
                       share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
                       rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta)
    return gpt.to(device)


def _vocab_parallel_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                             inv_temp: float) -> torch.Tensor:
    """hidden [n, H], targets [n] (full-vocabulary ids), weight [V/tp, H] this rank's head shard -> [n] float32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = F.linear(hidden, weight).float()  # [n, V/tp]
    if inv_temp != 1.0:
        logits = logits * inv_temp
    return -vocab_parallel_cross_entropy(logits, targets)


class MegatronPolicy(torch.nn.Module):
    """token ids -> [B, L-1] log-probs of the scored tokens, on a (tensor-parallel) GPTModel."""

    def __init__(self, gpt: torch.nn.Module, temperature: float, packed: bool = False, chunk_tokens: int = 1024):
        super().__init__()
        self.gpt = gpt
        self.inv_temp = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
        self.packed = packed
        self.chunk_tokens = chunk_tokens

    def head_weight(self) -> torch.nn.Parameter:
        """This rank's vocabulary shard of the LM head (the embedding's when tied)."""
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, H] final hidden states (after the final norm)."""
        if self.packed:
            return self._packed_hidden(input_ids, attention_mask)
        B, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device).expand(B, L)
        decoder_input, rotary = self.gpt._preprocess(input_ids=input_ids, position_ids=positions)[:2]
        out = self.gpt.decoder(hidden_states=decoder_input, attention_mask=causal_mask(L, input_ids.device),
                               rotary_pos_emb=rotary)  # [L, B, H]
        return out.transpose(0, 1)

    def _packed_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """THD: the real tokens of all rows as one sequence [T, 1, H] (Transformer Engine), scattered back to
        [B, L, H] (padding positions zero)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = attention_mask.sum(dim=1).to(torch.int32)  # [B]
        cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))  # [B+1]
        real = attention_mask.bool()
        tokens = input_ids[real][None]  # [1, T]
        positions = (torch.cumsum(attention_mask, dim=1) - 1)[real][None]
        longest = int(lengths.max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        decoder_input, rotary = self.gpt._preprocess(input_ids=tokens, position_ids=positions,
                                                     packed_seq_params=params)[:2]
        out = self.gpt.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary,
                               packed_seq_params=params)  # [T, 1, H]
        hidden = out.new_zeros(*input_ids.shape, out.shape[-1])
        hidden[real] = out[:, 0]
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                score_mask: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        B, L = input_ids.shape
        rows, cols = score_mask.nonzero(as_tuple=True)  # [N] each
        targets = input_ids[:, 1:][rows, cols]  # [N]
        h = self.hidden(input_ids, attention_mask)[:, :-1][rows, cols]  # [N, H]
        h = copy_to_tensor_model_parallel_region(h)
        picked = chunked_logprobs(_vocab_parallel_logprobs, h, targets, self.head_weight(), self.inv_temp,
                                  chunk_tokens=self.chunk_tokens)
        out = torch.zeros(B, L - 1, dtype=torch.float32, device=input_ids.device)
        return out.index_put((rows, cols), picked)
