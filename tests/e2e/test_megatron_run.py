"""`async-rl run` with the megatron trainer backend (TP=2 on two CPU ranks), as a user runs it,
and the refusals that stop such a run before anything starts."""

import importlib.metadata
import json
import os

import pytest

from async_rl.config import Config, ModelConfig, TrainerConfig
from async_rl.placement import place
from async_rl.trainer.backends import get_backend
from tests.e2e.test_fsdp_run import DEBUG, cli


@pytest.mark.slow
def test_run_with_megatron_tp2_completes_and_its_checkpoint_is_an_hf_model(tmp_path):
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    from transformers import AutoModelForCausalLM

    steps = 3
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", "trainer.backend=megatron", "trainer.world_size=2",
              "trainer.tensor_parallel=2", f"total_steps={steps}", "log.progress=false")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trainer compute dtype: float32 (trainer.backend=megatron: bf16 on CPU fails" in res.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train/num_tokens"] > 0 and r["train/optimizer_steps"] == 1 for r in rows)
    assert "greedy accuracy" in res.stdout
    rank1 = (tmp_path / "logs" / "trainer_rank1.log").read_text()
    assert "megatron rank 1/2 on cpu: TP rank 1/2, DP rank 0/1" in rank1 and "stop after" in rank1
    ckpt = tmp_path / "checkpoints" / f"step_{steps:06d}"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert json.loads((ckpt / "meta.json").read_text())["policy_version"] == steps


def _megatron(**trainer) -> Config:
    return Config(model=ModelConfig(tiny_alphabet="01234+="),
                  trainer=TrainerConfig(backend="megatron", device="cpu", **{"world_size": 2, **trainer}))


def test_what_megatron_cannot_run_is_refused_with_one_line(monkeypatch):
    check = get_backend("megatron").check
    cores = len(os.sched_getaffinity(0))
    cases = [
        (_megatron(world_size=cores + 1, tensor_parallel=1), rf"^trainer.world_size: {cores + 1} CPU ranks need"),
        (_megatron(compute_dtype="bfloat16"), r"^trainer.compute_dtype: bfloat16 on CPU fails in megatron-core"),
        (_megatron(megatron_spec="te"), r"^trainer.megatron_spec: te \(Transformer Engine\) runs on CUDA only"),
        (_megatron(pack_sequences=True), r"^trainer.pack_sequences: packed \(THD\) micro-batches need"),
        (Config(model=ModelConfig(tiny_alphabet="01234+=", tiny_kv_heads=1),
                trainer=TrainerConfig(backend="megatron", device="cpu", world_size=2, tensor_parallel=2)),
         r"^trainer.tensor_parallel: 2 does not divide the model's key/value heads \(1\)"),
        (Config(model=ModelConfig(tiny_alphabet="01234+=x"),  # 3 specials + 8 characters
                trainer=TrainerConfig(backend="megatron", device="cpu", world_size=2, tensor_parallel=2)),
         r"^trainer.tensor_parallel: 2 does not divide the model's vocabulary size \(11\)"),
    ]
    if cores < 2:
        cases = cases[:1]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            check(cfg)

    # more CUDA ranks than GPUs: the GPU pools' rule (async_rl/placement.py), which megatron ranks go by too
    gpus = Config(trainer=TrainerConfig(backend="megatron", device="cuda", world_size=4, tensor_parallel=2))
    with pytest.raises(ValueError, match=r"^trainer.world_size: 4 ranks need 4 GPUs \(one each\), but 2"):
        place(gpus, visible=2, sides=("trainer",))

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ValueError, match=r"^trainer.backend: megatron needs megatron-core==0.16.1, which is not "
                                         r"installed; pip install -e '.\[megatron\]'"):
        check(_megatron())


def test_a_tp_size_that_does_not_divide_the_heads_stops_the_run_with_one_line(tmp_path):
    res = cli("run", "--config", DEBUG, f"run_dir={tmp_path}", "trainer.backend=megatron", "trainer.world_size=2",
              "trainer.tensor_parallel=2", "model.tiny_heads=2", "model.tiny_kv_heads=1", "total_steps=3",
              "log.progress=false", timeout=180)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: trainer.tensor_parallel: 2 does not divide the model's key/value heads (1); "
                      "pick a divisor of 1"], res.stderr[-3000:]
