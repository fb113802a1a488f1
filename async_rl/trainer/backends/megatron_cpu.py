"""megatron-core on this project's terms: the version it was checked against, and the CPU shims.

    megatron = require_megatron()      # ImportError-free check: a ValueError naming the extra to install
    install_cpu_shims()                # once per process, before a GPTModel is built on CPU

megatron-core writes CUDA into code paths that a CPU run goes through. Each shim below
replaces exactly one of them, and says why; none changes what is computed. They were
checked against megatron-core 0.16.1 (the newest release for Python 3.11), which
`require_megatron` asserts: another version may have moved the CUDA calls, and then a
shim would silently do nothing. Not shimmed, avoided instead: megatron's schedules and
optimizer (`device="cuda"` literals; this project's loop and `torch.optim.AdamW` run
instead), its fused kernels (off in the TransformerConfig the backend builds), and
`attention_mask=None` (it builds a causal mask on "cuda": the backend passes its own).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from typing import Any

import torch

MEGATRON_VERSION = "0.16.1"
_INSTALL = "pip install -e '.[megatron]' (make install does this)"


def require_megatron() -> Any:
    """megatron.core, or ValueError naming trainer.backend when it is missing or another version."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"trainer.backend: megatron needs megatron-core=={MEGATRON_VERSION}, which is not "
                         f"installed; {_INSTALL}") from None
    if version != MEGATRON_VERSION:
        raise ValueError(f"trainer.backend: megatron was checked against megatron-core=={MEGATRON_VERSION}, "
                         f"this environment has {version}; {_INSTALL}")
    import warnings

    # Known, and said in docs/training.md: without Apex / Transformer Engine megatron uses torch's own norms and
    # kernels. Printed by every trainer process at import and at every layer spec otherwise.
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    import megatron.core

    return megatron.core


class _CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker. Attention forks the "model-parallel-rng"
    state on every forward (tensor_parallel/random.py: `get_cuda_rng_tracker().fork()`), and the
    real tracker saves and restores `torch.cuda` RNG states to do it. Dropout is 0 in this
    backend (asserted where the config is built), so there is no random stream to fork on CPU."""

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return True

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: dict) -> None:
        del states

    def add(self, name: str, seed: int) -> None:
        del name, seed


@functools.cache
def install_cpu_shims() -> None:
    """Make megatron-core 0.16.1 run on CPU (idempotent). Only for processes whose trainer is on CPU:
    on a CUDA rank none of this is needed, and `torch.cuda.current_device` must stay real."""
    require_megatron()
    # 1. RotaryEmbedding moves `inv_freq` to `torch.cuda.current_device()` on its first forward
    #    (models/common/embeddings/rotary_pos_embedding.py, get_emb), and GlobalMemoryBuffer
    #    allocates there (utils.py). A CPU process has no current CUDA device; "cpu" is a device
    #    string `.to()` and `torch.empty(device=...)` accept, so both stay on CPU.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # 2. The RNG tracker (above): the real one calls torch.cuda.get_rng_state on every attention forward.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # 3. The attention mask: megatron builds a default causal mask with device="cuda" when it is
    #    given none (transformer/utils.py, get_default_causal_mask); `causal_mask` below is passed
    #    explicitly instead, so that path is never taken. Nothing to patch.


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] bool, True where a position must not attend (megatron's convention): the future.

    Rows are right-padded (batching.collate), so real tokens never see padding under a causal
    mask alone, and megatron's RoPE, which ignores position ids, counts positions from 0 as HF does."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]
