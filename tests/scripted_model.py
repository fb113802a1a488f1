"""A real Llama checkpoint whose greedy (and, in practice, sampled) output follows a script.

Agent-loop tests need a model that *does* call tools, answers after tool results, and samples
token sequences whose decode-then-encode differs — a random tiny model does none of that.
This builds one by hand, as a genuine `LlamaForCausalLM` checkpoint that the embedded engine
and the trainer load like any other (real forward passes, real log-probs, real versions):

- the tokenizer is character-level over printable ASCII plus ChatML specials, plus "pieces":
  multi-character added tokens (`<tool_call>`, a whole JSON call, a turn marker ...);
- embeddings are one-hot, every layer's output projections are zero, so the residual stream
  at a position is the embedding of that position's token: the model is a bigram table;
- `lm_head` puts a large logit on each token's scripted successor (`chains`), so at
  temperature 1 the scripted token has probability ~1 - 1e-12.

The chat template marks the assistant turn with its index: the generation prompt of the
k-th assistant turn ends with the piece `<tk>` (k = 0, 1, ...), so a chain starting at `<t0>`
is what the model says in its first turn, `<t1>` in its second, and so on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
MAX_TURNS = 8
TURN_MARKERS = [f"<t{k}>" for k in range(MAX_TURNS)]
# renders tools (Hermes style) into the system turn, tool results as "tool" turns, and marks
# the k-th assistant turn with <tk> right after its header
TEMPLATE = (
    "{%- set ns = namespace(k=0) -%}{%- set nl = '\\n' -%}"
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|>\n{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_start|>assistant\n<t{{ ns.k }}>{{ m['content'] }}<|im_end|>{{ nl }}"
    "{%- set ns.k = ns.k + 1 -%}"
    "{%- else -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ nl }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<t{{ ns.k }}>{% endif -%}"
)

# a default script: turn 0 makes two tool calls in one turn, turn 1 answers "42" as the
# characters "4" and "2" (the tokenizer also has the piece "42": decode-then-encode differs)
CALC = '{"name": "calculator", "arguments": {"expression": "40+2"}}'
SLEEP = '{"name": "sleep", "arguments": {"seconds": 0.5}}'
DEFAULT_CHAINS = [
    ["<t0>", "<tool_call>", CALC, "</tool_call>", " <tool_call>", SLEEP, "</tool_call>\n", "<|im_end|>"],
    ["<t1>", "The answer is ", "4", "2", "<|im_end|>"],
]
DEFAULT_PIECES = ["42"]


def build_scripted_checkpoint(out: str | Path, chains: list[list[str]] = DEFAULT_CHAINS,
                              extra_pieces: list[str] = DEFAULT_PIECES, logit: float = 40.0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer) to `out`; returns the directory."""
    out = Path(out)
    pieces = list(dict.fromkeys(TURN_MARKERS + [t for c in chains for t in c if len(t) > 1 and t not in SPECIALS]
                                + list(extra_pieces)))
    chars = list(dict.fromkeys(PRINTABLE))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    base = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    base.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    base.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=base, pad_token="<pad>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", unk_token="<pad>", clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tok.chat_template = TEMPLATE

    ids = {t: tok.convert_tokens_to_ids(t) for c in chains for t in c}
    successor: dict[int, int] = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            if ids[a] in successor and successor[ids[a]] != ids[b]:
                raise ValueError(f"token {a!r} has two successors in the script")
            successor[ids[a]] = ids[b]

    vocab_size = len(tok)
    hidden = vocab_size + (-vocab_size) % 16  # 8 heads of an even width
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, hidden))
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        # after the final RMSNorm a one-hot of token i is sqrt(hidden) * e_i
        scale = logit / hidden ** 0.5
        for a, b in successor.items():
            model.lm_head.weight[b, a] = scale
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
