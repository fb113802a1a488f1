"""Engine, trainer and weight-sync numbers of a GPU set-up, derived from published numbers (a roofline).

A profile's `derive:` section names the GPU (peak bf16 FLOP/s, HBM bandwidth, memory), the model
(parameters, layers, KV heads, head size) and the fractions of peak each phase reaches, each with
its source. From them:

- decode step = weights / (HBM BW x hbm) + context x KV bytes per token / (HBM BW x hbm)
                + sequences x 2 N / (FLOP/s x decode_flops) + step_overhead_s     (per server of `tp` GPUs)
- prompt / KV-recompute token = 2 N / (FLOP/s x prefill_flops)
- trained token = train_flops_per_param_token x N / (FLOP/s x train_mfu)        (per GPU; data parallel)
- weight update = sync_fixed_s + bf16 weights / interconnect bandwidth
- max_running = what the KV cache left by the weights holds at the mean context

Explicit `engine:` / `trainer:` / `sync:` keys in the profile override what is derived here.
"""

from __future__ import annotations

from typing import Any

from async_rl.sim.lengths import LengthDist

_NEED = {"gpu": ("bf16_tflops", "hbm_tb_s", "memory_gb"), "model": ("params", "layers", "kv_heads", "head_dim"),
         "efficiency": ("hbm", "decode_flops", "prefill_flops", "train_mfu")}


def _number(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if isinstance(value, str):  # YAML 1.1 reads 1.78e9 (no dot before the e, no sign) as text
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}.{key}: expected a number > 0, got {value!r}")
    return float(value)


def derive(data: dict[str, Any]) -> dict[str, Any]:
    """The profile mapping with engine / trainer / sync filled from its `derive:` section."""
    d = data["derive"]
    if not isinstance(d, dict):
        raise ValueError("derive: expected a mapping")
    nums = {}
    for part, keys in _NEED.items():
        section = d.get(part)
        if not isinstance(section, dict):
            raise ValueError(f"derive.{part}: missing (needs {', '.join(keys)})")
        for key in keys:
            nums[key] = _number(section, key, f"derive.{part}")
    tp = int(d.get("tp", 1))
    flops, bw = nums["bf16_tflops"] * 1e12, nums["hbm_tb_s"] * 1e12
    params = nums["params"]
    weight_bytes = 2.0 * params  # bf16
    kv_bytes = 2.0 * nums["layers"] * nums["kv_heads"] * nums["head_dim"] * 2.0  # K and V, bf16, per token
    eff = d["efficiency"]
    engine = {
        "step_base_s": weight_bytes / tp / (bw * nums["hbm"]) + float(eff.get("step_overhead_s", 0.0)),
        "per_ctx_token_s": kv_bytes / tp / (bw * nums["hbm"]),
        "per_seq_s": 2.0 * params / tp / (flops * nums["decode_flops"]),
        "per_prefill_token_s": 2.0 * params / tp / (flops * nums["prefill_flops"]),
        "units": tp, "scaling": 1.0,
        "max_running": _max_running(d, data, weight_bytes, kv_bytes, tp, nums["memory_gb"]),
        "max_tokens_per_step": int(d.get("max_tokens_per_step", 8192)),
    }
    trainer = {"per_token_s": float(d.get("train_flops_per_param_token", 8.0)) * params / (flops * nums["train_mfu"]),
               "step_overhead_s": float(d.get("train_step_overhead_s", 0.0)), "units": 1, "scaling": 1.0}
    link = float(d.get("interconnect_gb_s", 0.0)) * 1e9
    transfer = weight_bytes / link if link > 0 else 0.0
    sync = {"publish_s": float(d.get("sync_fixed_s", 0.0)), "bytes": weight_bytes, "bandwidth_bytes_s": link,
            "load_s": float(d.get("load_fixed_s", 0.0)) + transfer, "recompute": True,
            "switch_s": float(d.get("colocate_switch_s", 0.0))}
    out = dict(data)
    for key, derived in (("engine", engine), ("trainer", trainer), ("sync", sync)):
        out[key] = {**derived, **(data.get(key) or {})}
    return out


def _max_running(d: dict, data: dict, weight_bytes: float, kv_bytes: float, tp: int, memory_gb: float) -> int:
    """Sequences the KV cache holds at the mean context (prompt + mean response), capped by `max_running_cap`."""
    free = memory_gb * 1e9 * tp * float(d.get("mem_fraction", 0.85)) - weight_bytes
    if free <= 0:
        raise ValueError(f"derive: the weights ({weight_bytes / 1e9:.1f} GB) do not fit mem_fraction of "
                         f"{tp} x {memory_gb} GB; raise derive.tp")
    response = LengthDist(**(data.get("response") or {}))
    context = float(data.get("prompt_len", 1)) + response.mean_length()
    return max(1, min(int(d.get("max_running_cap", 1024)), int(free / kv_bytes / context)))
