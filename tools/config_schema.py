"""The typed recipe schema: one dataclass per section of a recipe, a docstring under every field.

These dataclasses are the source of truth of what a recipe may say; a recipe YAML is only
data. `tidal.tools.config` loads recipes into them (OmegaConf structured configs), checks
what a type cannot express, and re-exports every name here, so code imports them from
there. `tidal config --keys` prints the field docstrings (`config_keys` reads them).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from tidal.engines.data import DataConfig


class Runtime(enum.Enum):
    local = "local"
    ray = "ray"


class Precision(enum.Enum):
    """Compute precisions of the train engines (`Platform.autocast`). No fp16: it needs
    loss scaling, which the engines do not do."""

    fp32 = "fp32"
    bf16 = "bf16"


class Attention(enum.Enum):
    """transformers attention implementations a model runs with."""

    sdpa = "sdpa"
    eager = "eager"


@dataclasses.dataclass
class ModelConfig:
    """The policy model: the built-in tiny Qwen2-architecture model (the CPU recipes), or a
    local Hugging Face checkpoint directory."""

    hidden_size: int = 128
    """Width of the tiny model."""
    num_layers: int = 2
    """Transformer layers of the tiny model."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_positions: int = 64
    """Longest sequence (prompt + answer) in tokens: at least the task's longest prompt (and <bos>) plus `rollout.max_new_tokens`."""
    attention: Attention = Attention.sdpa
    """transformers attention implementation: sdpa (torch's fused kernels) or eager (plain
    matmuls: faster on CPU for sequences of a few tokens, where the fused CPU kernel's
    per-call cost dominates)."""
    source: str = "tiny"
    """Where the model, its tokenizer and its first weights come from: tiny (built here from
    the shape keys above and the seed, with a character tokenizer) | hf (the checkpoint
    directory `model.path`, with its own tokenizer; the shape keys do not apply)."""
    path: Optional[str] = None
    """Local Hugging Face checkpoint directory (config.json, safetensors, tokenizer files and
    chat template, generation_config.json) for model.source=hf; loaded with
    AutoModelForCausalLM and AutoTokenizer, nothing downloaded."""
    dtype: str = "float32"
    """Weight dtype of an hf model as loaded: float32 | bfloat16 | auto (the checkpoint's own).
    float32 keeps master weights and optimizer state exact; train.precision=bf16 still computes in bf16."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the checkpoint directory (custom model
    classes); only for checkpoints whose code you trust."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory,
    about a third more compute); hf models."""


@dataclasses.dataclass
class TaskConfig:
    """What the policy learns: prompts and the verifier that scores answers."""

    name: str = "arithmetic"
    """Prompt generator: arithmetic | countdown (not used when `data.train_files` gives the prompts)."""
    reward: str = ""
    """Reward: a registry name (arithmetic, countdown, exact_match: strict, the answer alone and then the end token; math, math_format, math_with_format: math-verify on `####` or `\\boxed{}` answers) or `module:function` (from the Python path, then the current directory); empty = the task's own (with data.train_files: needed)."""
    reward_workers: Optional[int] = None
    """Worker processes that run the reward, each sample under `task.reward_timeout_s`; 0 = in the reward stage's thread, with no timeout; null = 2 for the math rewards (math, math_format, math_with_format: math-verify's own timeout works only in a process's main thread, and a pathological answer can hang its parser), 0 for the others (cheap and bounded)."""
    reward_timeout_s: float = 10.0
    """Longest the reward may take on one sample in a worker process (`task.reward_workers` > 0); a sample past it scores 0, its worker is replaced, and it is counted in the `reward_timeouts` metric (and in `failed_rewards`). > 0."""
    max_value: int = 20
    """Largest operand of arithmetic prompts."""
    ops: str = "+-"
    """Operators arithmetic prompts use."""
    num_numbers: int = 3
    """Numbers in a countdown prompt (each used once to reach its target)."""
    max_number: int = 10
    """Largest number of countdown prompts (numbers are 1..max_number)."""
    num_eval_prompts: int = 200
    """Held-out prompts (drawn with another seed) for the accuracy reported before and after RL."""
    exclude_eval_prompts: bool = False
    """Never train on a problem of the evaluation set (countdown: the same numbers, in any order, and target; use for tasks with many distinct prompts)."""


@dataclasses.dataclass
class SFTConfig:
    """Supervised warm start, so RL begins with some signal."""

    steps: int = 150
    """Optimizer steps of supervised training on prompt + answer (0 = none)."""
    batch_size: int = 64
    """Examples per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm start."""


@dataclasses.dataclass
class RolloutConfig:
    """The rollout engine."""

    backend: str = "hf"
    """Rollout adapter: hf (a transformers model sampled with a KV cache, any platform)."""
    temperature: float = 1.0
    """Sampling temperature (behavior logprobs are computed at it)."""
    max_new_tokens: int = 6
    """Generated-token budget per sample."""
    chunk_tokens: int = 3
    """Tokens decoded between safe points, where new weights may be applied (partial rollout)."""
    prompts_per_generate: int = 16
    """Prompts (times group_size samples) per generate batch."""
    continuous_batching: bool = True
    """Refill the generate batch as groups end: a group whose samples all ended goes to
    training at once, and admitted prompts join the batch in its place, so a short
    response's slot does not idle until the longest ends (false: a batch runs until every
    sample in it ends)."""
    threads: int = 0
    """torch intra-op threads of the rollout stage; 0 = the run's `threads`."""


@dataclasses.dataclass
class TrainConfig:
    """The train engine."""

    backend: str = "torch"
    """Train adapter: torch (plain torch, one process) | fsdp (FSDP2, a process per placement.train instance) | deepspeed (DeepSpeed ZeRO, train.zero_stage; a process per placement.train instance)."""
    lr: float = 1e-3
    """AdamW learning rate of the RL phase."""
    lr_schedule: str = "constant"
    """Learning-rate schedule of the RL phase, after the warmup: constant (lr throughout) | cosine (from lr down to `train.min_lr_ratio` x lr at the last RL step, `algorithm.num_steps`). A resumed run goes on along it."""
    warmup_steps: int = 0
    """RL steps of linear warmup before the schedule: step k (from 0) trains at lr x (k + 1) / (warmup_steps + 1). 0 = none. >= 0."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's lr at the last RL step, as a share of `train.lr`. In [0, 1]."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    max_nonfinite_steps: int = 5
    """Optimizer steps in a row whose gradient norm is NaN or infinite that are skipped (weights and optimizer state kept, the step still counts) before the run stops with an error; 0 = stop at the first."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradients accumulate over a step)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Tokens per forward/backward at most, so memory follows tokens, for long generations: padding-free (train.padding_free), the rows' real tokens (the packed rows that hold them, or a padded micro-batch of rows too alike to pack, are at most about 2.5 times that); padded, rows x the longest of them (rows of similar length go together). A row longer than this runs alone; within train.micro_batch_size rows too. The loss and gradient are the same however the rows are cut. null = rows only; >= 2."""
    padding_free: Optional[bool] = None
    """Micro-batches without padding (verl's use_remove_padding): each row's real tokens back to back, its positions from 0, no attention mask, and transformers keeps each token to its own row (flash attention: all tokens in one row, varlen kernels; sdpa, eager, flex: rows as wide as the longest, filled first-fit, so their dense masks stay within the padded forward's; a micro-batch whose rows would not share them runs padded). The same loss and gradient as padded, up to float rounding. null = wherever the model can (a transformers model built on its attention interface, whose forward takes position_ids) | true (an error where it cannot) | false (each micro-batch padded to its longest row). The torch backend keeps its shared-prompt packing where that saves a fifth of the real tokens (long prompts, short responses)."""
    threads: int = 0
    """torch intra-op threads of the train stage; 0 = the run's `threads`."""
    precision: Precision = Precision.fp32
    """Compute precision of the RL phase's forward passes: fp32 | bf16 (matmuls in bf16 under the platform's autocast; weights, gradients, optimizer state and logprobs stay fp32; the warm start stays fp32)."""
    zero_stage: int = 2
    """train.backend=deepspeed only: what DeepSpeed ZeRO shards over the trainer ranks: 1 (the optimizer state: AdamW's moments and fp32 master weights) | 2 (also the gradients) | 3 (also the weights, gathered module by module for each forward and backward). Every stage trains the same weights; higher stages hold less per rank and communicate more."""


@dataclasses.dataclass
class AlgorithmConfig:
    """The RL algorithm and its staleness bound."""

    num_steps: int = 30
    """Optimizer steps of RL."""
    prompts_per_step: int = 8
    """Prompts per optimizer step."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    max_staleness: int = 1
    """A sample from version v is trainable by versions v .. v + max_staleness; 0 = synchronous on-policy."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | grpo_no_std | rloo | dr_grpo."""
    clip_low: float = 0.2
    """PPO clip below 1."""
    clip_high: float = 0.28
    """PPO clip above 1 (clip-higher when larger than clip_low)."""
    aggregation: str = "token_mean"
    """Loss aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum | token_sum_norm."""
    decoupled: bool = True
    """Decoupled PPO: ratio against the trainer's weights before the step (its own logprobs, no extra pass), weighted by behavior IS."""
    tis_cap: Optional[float] = 2.0
    """Truncate the behavior importance weight at this value (truncated IS); null = no cap."""
    kl_coef: float = 0.0
    """KL penalty to the initial (warm-started) policy, a frozen copy the train engine keeps
    (and checkpoints); 0 = none. train.backend=torch only."""
    entropy_coef: float = 0.0
    """Entropy bonus (verl's entropy_coeff): this times the aggregated entropy of the policy's next-token distributions is subtracted from the loss, against entropy collapse; 0 = none (the entropy is still reported as the `entropy` metric); >= 0. Like kl_coef, a value > 0 trains rows whose advantage is 0 too."""
    kl_estimator: str = "k3"
    """Per-token estimator of the KL penalty, with d = reference - policy logprob: k1 (-d) | k2 (d^2 / 2) | k3 (exp(d) - d - 1: unbiased, low variance, >= 0; verl's low_var_kl, bounded as verl bounds it: d within [-20, 20], the estimate at most 10)."""
    level: str = "token"
    """Where the PPO ratio lives: token (one per token, PPO) | sequence (GSPO: one per sequence, the geometric mean of its token ratios, with the sequence's advantage; the GSPO paper pairs it with aggregation=seq_mean_token_mean)."""
    seq_mask_low: Optional[float] = None
    """Sequence masking: leave out of the loss every sequence whose geometric-mean behavior weight, exp(mean over its tokens of proximal - behavior logprob), is below this; null = no lower bound."""
    seq_mask_high: Optional[float] = None
    """Sequence masking: leave out every sequence whose geometric-mean behavior weight is above this; null = no upper bound."""
    dual_clip: Optional[float] = None
    """Dual-clip PPO (verl's clip_ratio_c, AReaL's c_clip; 3.0 is usual): a token (a sequence with level=sequence) whose advantage is negative costs at most dual_clip * |advantage|, and no gradient beyond; null = off; > 1. Acts on the ratio to the proximal policy: with decoupled=true that ratio is 1 within a step, so only with decoupled=false."""
    overlong: str = "none"
    """What a response cut at rollout.max_new_tokens (finish_reason "length") does to training (DAPO): none | filter (no gradient: its tokens leave the loss mask) | penalty (a soft penalty added to its reward: 0 up to the last `overlong_buffer` tokens before the limit, then linear down to -1 at it)."""
    overlong_buffer: int = 0
    """overlong=penalty: the last tokens before rollout.max_new_tokens over which the penalty falls from 0 to -1; 1..rollout.max_new_tokens (DAPO: a fifth of the budget, 4096 of 20480)."""


@dataclasses.dataclass
class NodeConfig:
    """Nodes of one shape in the cluster."""

    name: str = "node"
    """Node name; with count > 1 the nodes are named <name>-0, <name>-1, ..."""
    kind: str = "cpu"
    """Device kind of the node: cuda | npu | cpu."""
    devices: int = 1
    """Devices per node (for cpu nodes: processes that may run one role instance each)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Extra tags the devices carry (their kind is a tag already; cuda devices also carry `gpu`)."""
    count: int = 1
    """How many such nodes."""


@dataclasses.dataclass
class ClusterConfig:
    """The devices a run may use (`tidal plan` shows what goes where)."""

    nodes: list[NodeConfig] = dataclasses.field(default_factory=list)
    """Nodes and their devices; empty = discovered (Ray's nodes under runtime ray, else this machine)."""
    fake: bool = False
    """Each process runs the fake:<kind>:<n> platform of its placement (CPU tensors): CI runs of NPU/GPU layouts."""


@dataclasses.dataclass
class RoleConfig:
    """Where one role's instances go."""

    requires: list[str] = dataclasses.field(default_factory=list)
    """Tags every device of an instance must carry, e.g. [npu] or [gpu, h100]; empty = any NPU or GPU, or any device on a cluster without them (CPU nodes of a cluster with NPUs or GPUs serve only roles that require [cpu])."""
    count: int = 1
    """Instances of the role (engine replicas or data-parallel ranks)."""
    devices_each: int = 1
    """Devices per instance, all on one node."""
    colocate_with: Optional[str] = None
    """Time-share that role's devices (colocated); instances beyond them take free devices (hybrid)."""
    lend_to: Optional[str] = None
    """While this role waits for data, its devices run instances of that role (multiplexed)."""


@dataclasses.dataclass
class TransportConfig:
    """How new weights travel from the trainer to rollout (runtime ray)."""

    name: str = "auto"
    """auto | ipc | collective | host; auto picks from the two platforms: ipc on one node (any two CPU processes of it; CUDA only colocated), else collective for one vendor, else host (NPU <-> GPU)."""
    bucket_mb: int = 16
    """Bucket size in MB: the unit that is copied off the device while the previous one is sent."""
    overlap: bool = False
    """The trainer stops waiting for the rollout actors to receive (rollout still waits for the
    version its prompts need). Over ipc the trainer's weights live in the shared buffer (the
    `torch` engine: a publish copies nothing, only announces the version, and the engine waits
    for the answers before its next optimizer step; `runtime.json`'s `weights_in_place`), or
    are written into it and announced, the answers collected before the next one; over
    collective and host it is sent from a copy on a thread of its own while the trainer takes
    its next step (one copy of the model on the trainer's device). Not with a rollout that
    time-shares the trainer's devices (a weight pass must end inside its turn)."""


@dataclasses.dataclass
class PlacementConfig:
    """Which devices each role uses; kept apart from the algorithm's settings."""

    train: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    """The trainer."""
    rollout: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    """The rollout engines."""


@dataclasses.dataclass
class FaultConfig:
    """What a `runtime: ray` run does when one of its actors dies or stops answering."""

    rollout_restarts: int = 3
    """How many times Ray restarts each dead rollout actor; it takes the current weights and continues, and the prompts it held are generated again."""
    trainer_restarts: int = 1
    """How many times a dead trainer actor is started again; it resumes from the run's last checkpoint (weights, optimizer, data, store)."""
    liveness_s: float = 30.0
    """How long a rollout actor or trainer rank may answer no ping (stopped, hung, its machine swapping) before tidal warns, naming it and how long it has been silent (`silent_rollouts` in the metrics counts rollout actors'); 0 turns the checks off."""
    liveness_grace_s: float = 60.0
    """How much longer a silent actor may stay silent before it is killed and handled as a death: restarted, and counted against `rollout_restarts` or `trainer_restarts`."""


@dataclasses.dataclass
class RecipeConfig:
    """A tidal recipe: what to run, on which platform, and where its files go."""

    name: str = "run"
    """Short name of the run; the default run directory is `<output_dir>/<name>-<timestamp>`."""
    description: str = ""
    """One line saying what this recipe trains; `tidal doctor` lists it."""
    device: str = "auto"
    """Platform: auto | cpu | cuda | npu | fake:<kind>:<n>. The TIDAL_DEVICE variable overrides it."""
    runtime: Runtime = Runtime.local
    """Where roles run: `local` (one process) or `ray` (actors on a Ray cluster)."""
    seed: int = 0
    """Seed for Python, NumPy, torch and every device generator."""
    output_dir: str = "runs"
    """Folder under which run directories are created."""
    run_dir: Optional[str] = None
    """Directory for this run's files (resolved config, metrics, checkpoints); must be new or empty. Relative paths (here, in output_dir and resume) are taken from where tidal run starts and stored absolute in config.yaml, so Ray actors on other nodes use the same folder."""
    resume: Optional[str] = None
    """A previous run directory to continue from its last checkpoint (weights, optimizer, data, version, RNG, store); its model's shape is kept."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many RL steps (and always at the end)."""
    eval_every: int = 0
    """Also measure held-out accuracy (greedy, as before and after RL) every this many RL steps, with the trainer's weights of that step, while training waits: the `held_out_accuracy` field of that step's metrics.jsonl line and points in progress.png. 0 = only before and after RL."""
    keep_checkpoints: int = 0
    """How many of the newest checkpoints to keep; older ones are deleted once a newer one is complete. 0 = keep all."""
    lease_s: float = 3600.0
    """Seconds a stage may hold rows it took from the store before they are handed out again.
    Must outlast any generation and two train steps; a stage that dies gives its rows back
    at once, so this only frees rows that a hung one holds."""
    tensorboard: bool = True
    """Also write each step's metrics as TensorBoard scalars to run_dir/tensorboard, when the tensorboard package is installed."""
    threads: int = 0
    """torch intra-op threads of the RL stages (rollout and training); 0 = torch's default.
    `rollout.threads` and `train.threads` set one stage's. The warm start and the evaluations
    run alone and always get torch's default: every core in one process; under `runtime: ray`
    the trainer actor's CPUs (Ray sets `OMP_NUM_THREADS` to them, 1 on the CPU quickstart)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    """Prompts and reward."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompts from local dataset files instead of the generated task (`data.train_files`)."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """Supervised warm start."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout engine."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Train engine."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """RL algorithm and staleness bound."""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    """Nodes and devices (empty = discovered)."""
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """Which devices each role uses."""
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    """Weight transport from trainer to rollout."""
    fault: FaultConfig = dataclasses.field(default_factory=FaultConfig)
    """Restarts after an actor dies (`runtime: ray`)."""
