"""The `megatron` trainer backend: PPO on a Megatron-core GPTModel, tensor parallel x data parallel.

    trainer = build(cfg, RankInfo(rank, world_size, store))   # every rank; TP = trainer.tensor_parallel
    stats = trainer.train_step(groups)                         # rank 0; the others: follow_train_step()
    for name, tensor in trainer.hf_tensors(): ...              # every rank; HF-named full tensors on rank 0

`trainer.world_size` ranks form `trainer.tensor_parallel`-sized TP groups (consecutive ranks,
megatron's order) and data parallel over the rest: rank r is TP rank r % TP of data-parallel
rank r // TP. The loop, loss, optimizer (torch AdamW; megatron's own has CUDA literals),
publishers and checkpoints are the ones every backend shares; what differs:

- The model is megatron's GPTModel (local spec on CPU, fp32; Transformer Engine on GPU where it
  imports), converted from the HF model at start (megatron_layout.py: each rank converts only
  its shard, one tensor at a time) and back to HF for every publish and checkpoint: each
  parameter's TP shards are gathered to rank 0 and converted there, one at a time
  (`hf_tensors`), so no rank holds a second copy of the model.
- Log-probs are vocab-parallel (megatron_model.py): no rank builds a full-vocabulary row.
- Data parallel: rank 0 sends each data-parallel rank its rows (spmd.py, the TP peers the same
  rows); after a minibatch's micro-batches the gradients are summed over the data-parallel group
  (bucketed all-reduce), which gives the single-process gradient (losses are token-sum weighted).
- Gradient clipping counts every parameter once: TP shards add their squared norms across the
  TP group, parameters every TP rank holds whole (the norms) are counted on TP rank 0 only.
- Checkpoints are plain HF directories (`model.safetensors` written tensor by tensor on rank 0)
  plus `optimizer.safetensors` (Adam's moments, converted to HF layout the same way): they do not
  depend on the TP size, and every rank reads its own shard back on resume.

CPU: the shims of megatron_cpu.py, fp32 only (bf16 under CPU autocast fails in megatron's
backward), padded rows. GPU only, refused on CPU: `trainer.megatron_spec=te`, bf16 compute,
`trainer.pack_sequences=true` (THD needs Transformer Engine).

Micro-batches stay padded rows here whatever `trainer.pack_sequences` says (`can_pack`), cut by
rows x longest: megatron's GPTModel takes no position ids that restart per sequence (its RoPE
counts columns, megatron_model.py), so the packed layout of the other backends would let the
sequences of a row see each other. `trainer.pack_sequences=true` (GPU, TE) packs inside the
forward instead (THD with cu_seqlens); null (auto) keeps padded rows on this backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_rl.config import Config, TrainerConfig
from async_rl.models import load_model, load_tokenizer, model_config, model_dir
from async_rl.trainer.backends import RankInfo, train_staleness, trainer_config
from async_rl.trainer.backends.megatron_cpu import install_cpu_shims, require_megatron
from async_rl.trainer.backends.megatron_layout import LlamaShape, Param, hf_specs, params, to_hf, to_shard
from async_rl.trainer.backends.megatron_model import MegatronPolicy, build_gpt
from async_rl.trainer.backends.scatter import read_meta
from async_rl.trainer.backends.spmd import SPMDTrainer, check_ranks, join_group
from async_rl.trainer.batching import Batch
from async_rl.trainer.checkpoint import HFTensors, TensorStream, hf_exporter, save_checkpoint
from async_rl.trainer.plan import score_mask
from async_rl.utils.hardware import DtypeChoice, resolve_dtype
from async_rl.utils.weights import WeightSource

logger = logging.getLogger(__name__)

_BUCKET_BYTES = 64 << 20  # data-parallel gradient all-reduce: one flat bucket of at most this many bytes
_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state, saved in HF layout


class MegatronTrainer(SPMDTrainer):
    """PPOTrainer over a tensor- and data-parallel GPTModel; see the module docstring."""

    can_pack = False  # padded rows; trainer.pack_sequences=true packs in the forward (THD), see above

    def __init__(self, policy: MegatronPolicy, cfg: TrainerConfig, shape: LlamaShape, layout: list[Param],
                 **kwargs: Any):
        from megatron.core import parallel_state as ps

        super().__init__(policy, cfg, **kwargs)
        self.shape, self.layout = shape, layout
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp = cfg.tensor_parallel
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.stats_group = ps.get_data_parallel_group()
        if self.dp_rank != self.dp_rank_of(self.rank):
            raise RuntimeError(f"megatron placed rank {self.rank} in data-parallel rank {self.dp_rank}, "
                               f"expected {self.dp_rank_of(self.rank)} (TP groups of consecutive ranks)")
        named = dict(policy.gpt.named_parameters())
        self.by_name = {p.name: named[p.name] for p in layout}
        self._tp_dim = {id(self.by_name[p.name]): p.tp_dim for p in layout}

    def dp_rank_of(self, rank: int) -> int:
        return rank // self.tp

    # ------------------------------------------------------------------ weights in HF naming
    def hf_tensors(self, source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
                   tied_alias: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective (every rank iterates it to the end): (HF name, full CPU tensor) on rank 0, one at a
        time in HF state_dict order; nothing elsewhere. `source` picks what of each parameter (default its
        weights; an optimizer moment). A tied LM head comes as the embedding's tensor object again."""
        source = source or (lambda p: p.detach())
        embedding = None
        for p in self.layout:
            shards = self._gather(source(self.by_name[p.name]))
            if shards is None:
                continue
            for name, t in to_hf(p, shards, self.shape):
                t = t.to("cpu")
                embedding = t if name == "model.embed_tokens.weight" else embedding
                yield name, t
        if self.shape.tied and tied_alias and embedding is not None:
            yield "lm_head.weight", embedding

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """This TP group's shards of one parameter on rank 0 (TP rank order), None elsewhere; only the
        first data-parallel replica takes part (the others hold the same)."""
        if self.dp_rank != 0:
            return None
        if self.tp == 1:  # a copy: what is yielded must not change with the next optimizer step
            return [local.detach().clone()] if self.rank == 0 else None
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)] if self.tp_rank == 0 else None
        dist.gather(local, parts, group_dst=0, group=self.tp_group)
        return parts if self.rank == 0 else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the HF-named weights on rank 0 ({} elsewhere): checkpoints' tests and tools."""
        return dict(self.hf_tensors())

    def weights(self) -> WeightSource:
        """Collective: the HF-named weights as a lazy source that rank 0 publishes tensor by tensor, each
        gathered from its TP shards when read (the other ranks gather along in `close()`); a tied LM head
        is an alias of the embedding, so it is gathered and sent once."""
        specs = hf_specs(self.shape)
        items = self.hf_tensors(tied_alias=False)
        dtype = next(iter(self.by_name.values())).dtype
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.shape.tied else {}

        def fetch(index: int) -> torch.Tensor | None:
            if self.rank != 0:  # nothing is yielded here: the first read runs every gather, in order
                for _ in items:
                    pass
                return None
            name, t = next(items)
            if name != specs[index][0]:
                raise RuntimeError(f"megatron weights: {name} arrived where {specs[index][0]} was expected")
            return t

        return WeightSource([n for n, _ in specs], [dtype] * len(specs), [tuple(sh) for _, sh in specs], fetch,
                            aliases, lazy=True)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any]) -> None:
        """Collective: rank 0 writes a plain HF directory, tensor by tensor, plus Adam's moments in HF layout."""
        weights = self.hf_tensors(tied_alias=False)
        moments = (item for key in _MOMENTS for item in self._moment_tensors(key))
        if self.rank == 0:
            specs = hf_specs(self.shape)
            save_checkpoint(path, TensorStream(specs, weights),
                            TensorStream([(f"{k}.{n}", s) for k in _MOMENTS for n, s in specs], moments,
                                         metadata={"step": str(self._adam_step())}),
                            step, extra, hf_export=self.hf_export)
        else:
            for _ in weights:
                pass
            for _ in moments:
                pass
        dist.barrier()

    def _adam_step(self) -> int:
        states = [self.optimizer.state.get(p, {}) for p in self.params]
        return int(states[0]["step"]) if states and "step" in states[0] else 0

    def _moment_tensors(self, key: str) -> Iterator[tuple[str, torch.Tensor]]:
        def moment(p: torch.nn.Parameter) -> torch.Tensor:
            state = self.optimizer.state.get(p, {})
            return state[key] if key in state else torch.zeros_like(p)
        return ((f"{key}.{name}", t) for name, t in self.hf_tensors(moment, tied_alias=False))

    def _load_shard(self, path: str) -> dict[str, Any]:
        """This rank's shard of a checkpoint's HF weights (and moments, when it has them), read tensor by tensor."""
        p = Path(path)
        meta = read_meta(p)
        with HFTensors(p) as get:
            load_shards(self.layout, self.by_name, get, self.tp_rank, self.tp, self.shape)
        optim = p / "optimizer.safetensors"
        if not optim.is_file():
            raise FileNotFoundError(f"{p}: has no optimizer.safetensors (a checkpoint of another backend? "
                                    "trainer.backend=megatron resumes its own checkpoints)")
        with HFTensors(optim) as get:
            step = int(get.metadata.get("step", "0"))
            self.optimizer.state.clear()
            if step:
                for param in self.layout:
                    target = self.by_name[param.name]
                    self.optimizer.state[target] = {
                        "step": torch.tensor(float(step)),
                        **{k: to_shard(param, lambda n, k=k: get(f"{k}.{n}"), self.tp_rank, self.tp,
                                       self.shape).to(target.device) for k in _MOMENTS}}
        return meta

    # ------------------------------------------------------------------ PPOTrainer seams
    def _logprobs(self, batch: Batch) -> torch.Tensor:
        with self._autocast():
            return self.model(batch.input_ids, batch.attention_mask, score_mask(batch))

    def _logprobs_entropy(self, batch: Batch) -> tuple[torch.Tensor, None]:
        """No entropy here: the vocabulary is split over the TP ranks (its sum would be one more all-reduce)."""
        return self._logprobs(batch), None

    def _clip_grads(self) -> float:
        """Sum the minibatch's gradients over the data-parallel ranks, then clip by the norm of the whole
        model: TP shards add up across the TP group, replicated parameters count once (TP rank 0)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        if self.dp_size > 1:
            _all_reduce_bucketed(grads, self.stats_group)
        tp_dims = [self._tp_dim[id(p)] for p in self.params]
        norms = [torch.linalg.vector_norm(g) if d is not None or self.tp_rank == 0 else g.new_zeros(())
                 for g, d in zip(grads, tp_dims)]
        sq = torch.stack(norms).pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        norm = sq.sqrt()
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return float(norm)

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        super().close()


def _all_reduce_bucketed(grads: list[torch.Tensor], group: Any) -> None:
    """SUM-all-reduce `grads` in place, a flat bucket of at most _BUCKET_BYTES at a time."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if g is None or (bucket and size + g.numel() * g.element_size() > _BUCKET_BYTES):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()


def load_shards(layout: list[Param], by_name: dict[str, torch.nn.Parameter], get: Callable[[str], torch.Tensor],
                tp_rank: int, tp: int, shape: LlamaShape) -> None:
    """Copy this TP rank's shard of every parameter from HF tensors `get(name)`, one parameter at a time."""
    with torch.no_grad():
        for p in layout:
            target = by_name[p.name]
            shard = to_shard(p, get, tp_rank, tp, shape)
            if shard.shape != target.shape:
                raise ValueError(f"{p.hf[0]}: gives a shard of shape {tuple(shard.shape)} for {p.name}, the model's "
                                 f"is {tuple(target.shape)} (a checkpoint of another model?)")
            target.copy_(shard)


# ---------------------------------------------------------------------- checks and build
def _spec(cfg: TrainerConfig, device: torch.device) -> bool:
    """Whether the Transformer Engine spec is used (`trainer.megatron_spec`); ValueError where it cannot be."""
    if cfg.megatron_spec == "local" or (cfg.megatron_spec == "auto" and device.type == "cpu"):
        return False
    if device.type == "cpu":
        raise ValueError("trainer.megatron_spec: te (Transformer Engine) runs on CUDA only; "
                         "use local (or auto) with trainer.device=cpu")
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        if cfg.megatron_spec == "te":
            raise ValueError("trainer.megatron_spec: te needs transformer_engine, which does not import here; "
                             "install it or use local") from None
        return False
    return True


def compute_dtype(spec: str, device: torch.device) -> DtypeChoice:
    """`auto` is float32 on CPU whatever the CPU: bf16 under CPU autocast fails in megatron-core's backward."""
    if spec == "auto" and device.type == "cpu":
        return DtypeChoice(torch.float32, "trainer.backend=megatron: bf16 on CPU fails in megatron-core's backward")
    return resolve_dtype(spec, device)


def check(cfg: Config) -> None:
    """Every refusal before anything starts: megatron missing, a model it cannot map, sizes TP does not
    divide, bf16 / TE / packing on CPU, more ranks than cores (GPUs: async_rl/placement.py)."""
    require_megatron()
    device = check_ranks(cfg.trainer)
    t = cfg.trainer
    if t.kl_coef > 0:
        raise ValueError(f"trainer.kl_coef: the megatron backend keeps no reference model yet (got {t.kl_coef}); "
                         "use trainer.backend=single, or trainer.kl_coef=0")
    if device.type == "cpu" and t.compute_dtype == "bfloat16":
        raise ValueError("trainer.compute_dtype: bfloat16 on CPU fails in megatron-core's backward; the megatron "
                         "backend trains in float32 on CPU (auto picks it)")
    te = _spec(t, device)
    if t.pack_sequences and not te:
        raise ValueError("trainer.pack_sequences: packed (THD) micro-batches need the Transformer Engine spec on "
                         "CUDA (trainer.megatron_spec=te); on CPU the megatron backend trains padded rows")
    LlamaShape.from_hf(model_config(cfg.model)).check_tp(t.tensor_parallel)


def build(cfg: Config, rank: RankInfo) -> MegatronTrainer:
    """Join the process group, set up megatron's TP / DP groups, build this rank's GPTModel shard from the
    HF weights, return its trainer."""
    check(cfg)
    device = join_group(cfg, rank, "megatron")
    if device.type == "cpu":
        install_cpu_shims()
        if cfg.trainer.compute_dtype == "auto":
            cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compute_dtype="float32"))
    from megatron.core import parallel_state as ps

    tp = cfg.trainer.tensor_parallel
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != tp:
        ps.destroy_model_parallel()  # a process that built another layout before (tests reuse processes)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    hf = _hf_source(cfg)
    shape = LlamaShape.from_hf(hf.config)
    te = _spec(cfg.trainer, device)
    layout = params(shape, te=te)
    gpt = build_gpt(shape, tp, te, device)
    named = dict(gpt.named_parameters())
    if set(named) != {p.name for p in layout}:
        raise RuntimeError(f"megatron layout: GPTModel's parameters {sorted(set(named) ^ {p.name for p in layout})} "
                           "differ from megatron_layout.params (a megatron-core version this was not checked with?)")
    with hf.tensors as get:
        load_shards(layout, named, get, ps.get_tensor_model_parallel_rank(), tp, shape)
    hf_config, hf = hf.config, None  # the HF weights go now: only this rank's shards stay
    policy = MegatronPolicy(gpt, cfg.rollout.temperature, packed=bool(cfg.trainer.pack_sequences))
    trainer = MegatronTrainer(policy, trainer_config(cfg), shape, layout, temperature=cfg.rollout.temperature,
                              max_staleness=train_staleness(cfg), seed=cfg.seed)
    logger.info("megatron rank %d/%d on %s: TP rank %d/%d, DP rank %d/%d, %s spec", rank.rank, rank.world_size,
                device, trainer.tp_rank, tp, trainer.dp_rank, trainer.dp_size, "te" if te else "local")
    if rank.rank == 0:
        trainer.hf_export = hf_exporter(hf_config, load_tokenizer(cfg.model))
    return trainer


@dataclasses.dataclass
class _HFSource:
    config: Any
    tensors: Any  # a context manager giving name -> tensor


def _hf_source(cfg: Config) -> _HFSource:
    """The HF weights to start from: the tiny model built from the seed, else the checkpoint's files read
    one tensor at a time."""
    if cfg.model.name == "tiny":
        hf = load_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.seed)
        return _HFSource(hf.config, contextlib.nullcontext(hf.state_dict().__getitem__))
    return _HFSource(model_config(cfg.model), HFTensors(model_dir(cfg.model)))
