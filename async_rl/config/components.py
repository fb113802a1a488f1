"""The sections of the components a run is made of, one dataclass each: model, engine, task, rollout,
agent, trainer; and `ConfigError`, which every part of this package raises.

Every field has a one-line doc and a default that works on a CPU. The run-wide sections and `Config`,
which composes them all, are in run.py; `async_rl.config` is the surface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A config file or override is missing, unknown, or ill-typed."""


Dtype = Literal["auto", "float32", "bfloat16"]


@dataclass
class ModelConfig:
    """Which model every side loads (async_rl/models.py), and the engine's dtype."""

    name: str = "tiny"  # "tiny" (built in-process), "smollm2-135m" (offline GGUF), or an HF checkpoint dir
    dtype: Dtype = "auto"  # the engine's weights; auto = bf16 only where native
    # The tiny model and its character tokenizer (used when name == "tiny").
    tiny_alphabet: str = "0123456789+= "  # characters of the tiny tokenizer, besides its special tokens
    tiny_hidden: int = 64  # hidden size of the tiny model
    tiny_layers: int = 2  # decoder layers of the tiny model
    tiny_heads: int = 4  # attention heads of the tiny model
    tiny_kv_heads: int = 2  # key/value heads of the tiny model
    tiny_intermediate: int = 128  # MLP width of the tiny model
    max_position: int = 512  # context length of the tiny model


@dataclass
class EngineConfig:
    """The generation servers: backend, device, batching, KV cache, and the HTTP server's options."""

    # this project's engine | SGLang servers (GPU) | vLLM servers (CPU or GPU), in their own environments
    backend: Literal["embedded", "sglang", "vllm"] = "embedded"
    # the interpreter of the engine's own environment (sglang, vllm: their pins differ from the trainer's);
    # "" = the .venv-vllm that `make install` builds (vllm), or this interpreter (sglang)
    python: str = ""
    start_timeout_s: float = 900.0  # how long a launched sglang/vllm server may take to answer /health
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto = CUDA when present)
    host: str = "127.0.0.1"  # address the generation server binds
    port: int = 0  # 0 picks a free port
    tp_size: int = 1  # tensor-parallel GPUs of one SGLang server (its ranks in the dist weight group)
    max_running: int = 64  # most sequences decoded together
    max_tokens_per_step: int = 2048  # token budget of one engine step (prefill + decode)
    kv_cache_mb: float = 256.0  # memory budget of the paged KV cache on CPU (on CUDA: engine.gpu_memory_fraction)
    # share of its GPU's memory the engine takes for weights + KV cache (SGLang: --mem-fraction-static); on CUDA
    # the embedded engine sizes its KV pool from it. 0 = auto: 0.4 where it shares a GPU with the trainer, else
    # 0.85 (embedded) or SGLang's own choice; a trainer sharing the GPU is held to the rest (async_rl/placement.py)
    gpu_memory_fraction: float = 0.0
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True  # reuse KV of shared prefixes (GRPO groups, turns)
    # embedded engine on a CPU: decoding sequences also keep their KV in rows of a slab, read in place by
    # attention instead of gathered from the paged pool every layer and step (async_rl/engine/decode_slab.py);
    # the slab takes at most kv_cache_mb more memory, and a step over that reads the pool
    decode_slab: bool = True
    # kernels compiled at first use for a CPU engine's steps: fp32 on AVX2, GEMMs of <= 128 rows and the slab's decode
    # attention (async_rl/engine/cpu_kernels.py); bf16 on AVX-512, norms with the residual add, rotary, SiLU x up and
    # the slab's decode attention (async_rl/engine/bf16_kernels.py). auto = where measured faster (fp32 on AVX2
    # without AVX-512, bf16 on AVX-512) and a C compiler builds them, torch's ops elsewhere | compiled (required: an
    # error where they cannot build) | torch (always)
    cpu_kernels: Literal["auto", "compiled", "torch"] = "auto"
    num_threads: int = 0  # torch threads for the engine; 0 = half the cores in async mode, all in sync
    max_new_tokens_limit: int = 4096  # largest max_new_tokens a request may ask for
    tool_parser: str = "hermes"  # how /v1/chat/completions reads tool calls from the text (async_rl/tool_parsers.py)
    # Bearer token the generation server requires on every route but /health(_generate) and
    # /get_model_info (/model_info), and the rollout side sends; "" = open (refused at start-up on an
    # engine.host other machines reach: async_rl/exposure.py). "env:NAME" reads it from environment
    # variable NAME, "file:PATH" from a file (`async-rl keys` writes DIR/api_key); a literal is redacted
    # from the saved config.yaml.
    api_key: str = ""
    insecure: bool = False  # true: serve an address other machines reach without api_key all the same, loudly
    # /generate with stream: true sends each chunk's new tokens only, not all so far (SGLang's
    # --incremental-streaming-output: O(n) bytes per response instead of O(n^2)); the rollout side reads
    # either shape; SGLang's own frontend (sglang.RuntimeEndpoint) needs false, SGLang's default
    incremental_streaming_output: bool = False
    # SGLang servers: --enable-deterministic-inference. Without it SGLang ignores every request's sampling_seed
    # (sampling_batch_info.py), so a run on SGLang is not reproducible; its batch-invariant kernels cost
    # throughput. The embedded engine always honours the seeds.
    deterministic_inference: bool = False


@dataclass
class TaskConfig:
    """The prompt stream and its held-out set (async_rl/tasks/)."""

    name: str = "arith"  # task registered in async_rl.tasks
    min_operand: int = 0  # smallest operand
    max_operand: int = 4  # largest operand
    ops: list[str] = field(default_factory=lambda: ["+"])  # operators to draw from
    prompt_format: Literal["raw", "chat"] = "raw"  # raw ("2+3=") | chat (a question through the chat template)
    answer_pick: Literal["last", "first"] = "last"  # which number of the response is the answer: last ("2+3=5") | first
    eval_size: int = 64  # held-out problems (distinct; at most a third of the task's problems), never trained on
    # validation problems: distinct, never trained on, none in the test set above (test and validation together at
    # most half the task's problems). They choose the run's best checkpoint (run_dir/best); the test set is
    # scored, never chosen on. 0 = none: the best is chosen on the test set, and the summary says so
    val_size: int = 0
    eval_seed: int = 12345  # seed that picks the held-out problems
    eval_targets: list[float] = field(default_factory=list)  # held-out accuracies whose time to reach the summary gives
    agents: list[str] = field(default_factory=list)  # agent loops samples name, cycled per prompt; [] = task default
    interactions: list[str] = field(default_factory=list)  # interactions samples name, cycled; [] = task default


@dataclass
class RolloutConfig:
    """The rollout side: sampling, admission under the staleness bound, servers, evaluation."""

    group_size: int = 8  # n: samples per prompt (one GRPO group)
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling for training rollouts
    top_k: int = -1  # top-k for training rollouts (-1 = off)
    max_new_tokens: int = 8  # response length limit
    # the reward of a response cut at that limit, in place of its score (rewards/shaping.py: a policy paid
    # for a right last number learns to stop writing; 0 = DAPO's hard overlong punishment); null = scored
    truncated_reward: float | None = None
    agent: str = "single_turn"  # default agent loop (a sample may name its own)
    max_concurrent: int = 64  # most requests in flight at once
    # a trajectory the trainer would drop (its first token more than max_staleness versions behind the
    # weights just loaded) is aborted and started again from its prompt under those weights, instead of
    # being generated to its end and dropped; false keeps generating it (the trainer drops and counts it)
    restart_stale: bool = True
    # async: run only as many versions ahead of the trainer (1..max_staleness) as keep it fed, moved by
    # one per step from how much the trainer found buffered (rollout/staleness.py; the trainer always
    # says, this side's setting decides); false = always max_staleness ahead, so a run the trainer
    # bottlenecks trains data about max_staleness versions old
    pace: bool = False
    # async: the pipeline starts one batch deep and admits the next version's batch whenever fewer than
    # fill_ramp x batch_size admitted trajectories are still generating, until max_staleness deep, so the
    # first batch (the trainer waits for it) does not share every decode step with eta more
    # (rollout/staleness.py); 0 = admit all max_staleness + 1 batches at once
    fill_ramp: float = 0.25
    # how a weight update stops each generation server (SGLang's /pause_generation modes): retract (the
    # requests in flight keep their tokens and recompute their KV under the new weights) | in_place (they
    # keep the KV the old weights computed and go on at once: no recompute; the tokens sampled after the
    # update are labelled with the new version) | abort (they come back partial and are re-submitted)
    pause_mode: Literal["retract", "in_place", "abort"] = "retract"
    # tokens a generation server gathers per streamed chunk of a rollout request (SGLang's per-request
    # sampling_params.stream_interval; the first token and the end always come at once). The stream is what
    # tells this side the tokens so far if a server dies; 1 = a chunk every step, which costs the server
    # and this side a JSON chunk per token of every request
    stream_interval: int = 1
    server_addrs: list[str] = field(default_factory=list)  # generation servers started elsewhere; empty = start our own
    num_servers: int = 1  # generation servers to start when server_addrs is empty
    health_interval_s: float = 5.0  # how often each server's health is checked; a failing one leaves rotation
    connect_timeout_s: float = 60.0  # how long to wait for servers and the trainer to answer
    eval_max_new_tokens: int = 16  # response length limit of the greedy evaluation
    trace_every: int = 0  # write a readable per-turn trace of every Nth episode to run_dir/traces.jsonl (0 = off)
    eval_every: int = 0  # also evaluate every N policy versions, beside training (0 = only before and after)
    # an episode's turns stay on one server (its prefix cache); the episode moves to the least-loaded
    # server when its own has more than this many requests in flight beyond that one (or leaves rotation)
    sticky_overload_margin: int = 8


@dataclass
class AgentConfig:
    """Agent loops: the tools and simulated users they may use, and the limits of one episode."""

    tools_config: str = ""  # YAML file of tools agent loops may call (see async_rl/agent/tools/base.py); "" = none
    interactions_config: str = ""  # YAML file of named interactions (simulated users); "" = none
    tool_parser: str = "hermes"  # how tool calls are read from the model's text (async_rl/tool_parsers.py)
    max_assistant_turns: int = 4  # most model turns of one episode
    max_user_turns: int = 4  # most interaction (simulated user) replies of one episode
    max_response_tokens: int = 512  # everything after the prompt (model + tool + user tokens); cut beyond
    max_parallel_tool_calls: int = 8  # tool calls of one turn run concurrently; more than this are refused
    modules: list[str] = field(default_factory=list)  # imported at start (rollout side and trainer): agents, tools, losses register


@dataclass
class TrainerConfig:
    """The trainer: backend and device, the optimisation step, loss and advantages, checkpoints."""

    # single (one process) | fsdp (world_size processes, FSDP2) | megatron (Megatron-core TP x DP)
    backend: Literal["single", "fsdp", "megatron"] = "single"
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto = CUDA when present)
    world_size: int = 1  # trainer processes (fsdp, megatron backends)
    tensor_parallel: int = 1  # megatron: ranks that split each layer's tensors; data parallel over world_size / this
    megatron_spec: Literal["auto", "local", "te"] = "auto"  # megatron layers: local (megatron-core's own) | te (GPU)
    # packed micro-batches: the trajectories of one back to back in one row (position ids restarting, attention
    # block-diagonal), cut by tokens, not rows x longest. null = auto: single and fsdp pack (padded where the
    # model fails the packing probe), megatron pads; true: pack or refuse (megatron: THD, GPU with te only);
    # false: padded rows
    pack_sequences: bool | None = None
    batch_size: int = 32  # B: trajectories per train step (a multiple of rollout.group_size)
    lr: float = 1e-3  # AdamW learning rate
    # its schedule over the train steps (trainer/lr_schedule.py LR_SCHEDULES): constant | linear | cosine, the
    # decays reaching lr_min_ratio x lr at step lr_decay_steps (0 = total_steps), after lr_warmup_steps of linear
    # ramp and lr_hold_steps at the full rate
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_hold_steps: int = 0
    lr_min_ratio: float = 0.0
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm (0 = off)
    eps_clip: float = 0.2  # PPO clip range
    behav_weight_cap: float = 5.0  # c: the behaviour weight pi_prox / pi_behav is cut at c (or masked: trainer.loss)
    minibatches: int = 1  # optimizer steps per train step (each on 1/minibatches of the batch)
    micro_batch_tokens: int = 4096  # token budget of one forward/backward (padded rows: rows x longest)
    # what one more forward/backward costs, in tokens: padded rows are cut into more micro-batches where
    # that saves more padding (a long-tailed batch padded to its longest response wastes most)
    micro_batch_overhead_tokens: int = 256
    # policy loss from trainer/loss.py LOSSES, by its behaviour-weight rule: decoupled_ppo (truncated at c) |
    # masked_is (dropped above c) | icepop (dropped outside [1/c, c]) | no_behav_correction (ablation)
    loss: str = "decoupled_ppo"
    # what the trainer does with a trajectory whose oldest sampled token is more than max_staleness versions
    # behind: drop (the whole trajectory, counted) | mask (train its tokens sampled within the bound; the older
    # ones stay as context, out of the loss; dropped only if none is within it). With restart_stale a generation
    # that goes over the bound starts again, which starves long answers; mask keeps them: it needs
    # rollout.restart_stale=false. Either way no trained token is more than max_staleness versions old.
    stale_tokens: Literal["drop", "mask"] = "drop"
    # DAPO's dynamic sampling: groups whose rewards are all equal are set aside (consumed, released from the
    # staleness count so as many more are admitted) until the batch holds batch_size trajectories with signal
    dynamic_sampling: bool = False
    # > 0: add kl_coef x KL(pi_theta || pi_ref) (k3 estimate per token) to the loss, pi_ref = the initial weights,
    # which the trainer then keeps as a frozen copy (one more model in memory, in the compute dtype); 0 = no copy
    kl_coef: float = 0.0
    # train/kl_init, KL(pi_start || pi_now) per token, from a forward of this many responses of the first step
    # after each update (trainer/kl_probe.py; no reference model); 0 = not measured
    kl_probe_seqs: int = 2
    # how token terms add up to a minibatch's loss (trainer/loss.py LOSS_AGGS): token_mean (each trained token
    # alike) | seq_mean_token_mean (GRPO: mean over sequences of their token means) | seq_mean_token_sum_norm
    # (Dr.GRPO: token sums / (loss_agg_tokens x sequences))
    loss_agg: str = "token_mean"
    loss_agg_tokens: int = 0  # seq_mean_token_sum_norm: the constant per-sequence divisor; 0 = rollout.max_new_tokens
    adv_std_norm: bool = True  # grpo, grpo_turn: divide group-centred rewards by the group std; false = centred only
    # estimator from trainer/advantages.py ADVANTAGES: grpo | grpo_turn (+ turn scores) | dr_grpo | rloo
    advantage: str = "grpo"
    turn_adv_coef: float = 1.0  # grpo_turn: weight of the group-normalised turn score on its turn's tokens
    checkpoint_every: int = 0  # also save a checkpoint every N steps (0 = only as checkpoint_budget allows)
    # Checkpoints are what a restarted trainer resumes from, and what commits consumption: the
    # rollout side keeps every trajectory until a checkpoint holds the step that trained it. Share of
    # the trainer's wall time checkpoints may take (a checkpoint is due once the time since the last
    # one is its cost / budget); 0 = only checkpoint_every and the end of the run.
    checkpoint_budget: float = 0.05
    keep_checkpoints: int = 2  # newest checkpoints of this run kept on disk (0 = all)
    resume: bool = False  # start from the newest checkpoint under run_dir/checkpoints (`--resume RUN_DIR`)
    # keep the version with the best held-out accuracy the run saw as run_dir/best (chosen on task.val_size's
    # validation set; async_rl/trainer/best_checkpoint.py): a CPU copy of each version due for evaluation waits for its score
    keep_best: bool = True
    compute_dtype: Dtype = "auto"  # autocast dtype; master weights and optimizer stay fp32
    num_threads: int = 0  # torch threads for the trainer; 0 = half the cores in async mode, all in sync
