"""The typed recipe schema: one dataclass per section of a recipe, a docstring under every field.

These dataclasses are the source of truth of what a recipe may say; a recipe YAML is only
data. `tidal.tools.config` loads recipes into them (OmegaConf structured configs), checks
what a type cannot express, and re-exports every name here, so code imports them from
there. `tidal config --keys` prints the field docstrings (`config_keys` reads them).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, ClassVar, Optional

from tidal.engines import tasks
from tidal.engines.data import DataConfig
from tidal.flow.config import AlgorithmConfig, Bounds, RolloutConfig, check_overlong

MAX_SEED = 2**64 - 1
"""The largest `seed` (torch.manual_seed's bound; larger ones failed with a traceback once the run directory was made)."""


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the CLI prints it and exits with code 2."""


class Runtime(enum.Enum):
    local = "local"
    ray = "ray"


class Precision(enum.Enum):
    """Compute precisions of the train engines (`Platform.autocast`). No fp16: it needs
    loss scaling, which the engines do not do."""

    fp32 = "fp32"
    bf16 = "bf16"


class WandbMode(enum.Enum):
    """How the wandb package logs a run."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


class Attention(enum.Enum):
    """transformers attention implementations a model runs with."""

    sdpa = "sdpa"
    eager = "eager"


@dataclasses.dataclass
class ModelConfig:
    """The policy model: the built-in tiny Qwen2-architecture model (the CPU recipes), or a
    local Hugging Face checkpoint directory."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"hidden_size": 1, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "intermediate_size": 1, "max_positions": 2})

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
    AutoModelForCausalLM and AutoTokenizer, nothing downloaded. A relative path is taken from
    where tidal run starts (a leading ~ is the home folder) and stored absolute in config.yaml."""
    dtype: str = "float32"
    """Weight dtype of an hf model as loaded: float32 | bfloat16 | auto (the checkpoint's own).
    float32 keeps master weights and optimizer state exact; train.precision=bf16 still computes in bf16."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the checkpoint directory (custom model
    classes); only for checkpoints whose code you trust. It reaches every load: the model,
    its tokenizer, vLLM, a led group's other ranks (the code files are sent with the
    model's class) and `tidal export`."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory,
    about a third more compute); hf models."""

    def check(self) -> None:
        from tidal.engines.models import DTYPES  # noqa: PLC0415

        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size}, model.num_heads={self.num_heads}, model.num_kv_heads={self.num_kv_heads}: "
                "hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")


@dataclasses.dataclass
class TaskConfig:
    """What the policy learns: prompts and the verifier that scores answers."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"max_value": 0, "reward_workers": 0, "num_eval_prompts": 1, "num_numbers": 1, "max_number": 1}, positive=("reward_timeout_s",))

    name: str = "arithmetic"
    """Prompt generator: arithmetic | countdown (not used when `data.train_files` gives the prompts)."""
    reward: str = ""
    """Reward: a registry name (arithmetic, countdown, exact_match: strict, the answer alone and then the end token; math, math_format, math_with_format: math-verify on `####` or `\\boxed{}` answers) or `module:function` (from the Python path, then the current directory); none = no function, the reward model's score alone (`reward_model.path`; no held-out accuracy is measured); empty = the task's own (with data.train_files: needed)."""
    reward_workers: Optional[int] = None
    """Worker processes that run the reward, each sample under `task.reward_timeout_s` (RL's rewards and the held-out evaluation's, each in a pool of its own); 0 = in the scoring thread, with no timeout; null = 2 for the math rewards (math, math_format, math_with_format: math-verify's own timeout works only in a process's main thread, and a pathological answer can hang its parser), 0 for the others (cheap and bounded)."""
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

    def check(self) -> None:
        try:
            tasks.check_ops(self.ops)  # the arithmetic prompts' own check, before the run directory
        except ValueError:
            raise ValueError(f"task.ops={self.ops!r} is not a non-empty set of the operators + - * (e.g. +-)") from None


@dataclasses.dataclass
class RewardModelConfig:
    """A reward model that scores each response, added to the task's reward (RLHF's
    Bradley-Terry reward models: OpenRLHF's `--reward_pretrain`, TRL's `reward_funcs` given
    a model, verl's `reward_model`). It runs in the trainer's process, on its device."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"batch_size": 1, "max_length": 2}, finite=("weight",))

    path: Optional[str] = None
    """Local Hugging Face checkpoint directory of a sequence-classification model with one label (`*ForSequenceClassification`, `num_labels: 1`) and its tokenizer; null = no reward model. It reads each prompt's conversation and the response in its own chat template (`engines.reward_model`). A relative path is taken from where tidal run starts and stored absolute in config.yaml."""
    weight: float = 1.0
    """Each sample's reward is the task's reward + weight x the reward model's score (with task.reward=none: weight x the score)."""
    batch_size: int = 8
    """Samples per forward pass of the reward model."""
    max_length: int = 2048
    """Longest input (prompt and response, in the reward model's tokens); a longer one loses its beginning, so the response's end is scored."""
    dtype: str = "float32"
    """Weight dtype as loaded: float32 | bfloat16 | auto (the checkpoint's own)."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the reward model's directory; only for checkpoints whose code you trust."""

    def check(self) -> None:
        from tidal.engines.models import DTYPES  # noqa: PLC0415

        if self.dtype not in DTYPES:
            raise ValueError(f"reward_model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")


@dataclasses.dataclass
class SFTConfig:
    """Supervised warm start, so RL begins with some signal."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"steps": 0, "batch_size": 1}, positive=("lr",))

    steps: int = 150
    """Optimizer steps of supervised training on prompt + answer (0 = none)."""
    batch_size: int = 64
    """Examples per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm start."""


@dataclasses.dataclass
class EvalConfig:
    """How held-out prompts are answered (before and after RL, and every `eval_every` steps)."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"samples": 1, "temperature": 0, "top_k": 0}, positive=("top_p",), why={"top_k": "0 turns it off"})

    samples: int = 1
    """Answers sampled per held-out prompt; held_out_accuracy is the share of all answers the reward scores 1.0 (verl's mean@N), held_out_pass_at_n the share of prompts with at least one (pass@N), and with a built-in reward (whose answers tidal reads) held_out_maj_at_n the share whose most frequent answer is right (maj@N). > 1 needs eval.temperature > 0."""
    temperature: float = 0.0
    """0 = greedy (plain argmax, whatever the checkpoint's generation config says); > 0 samples at it, from the evaluation's own generator seeded by `seed` (each evaluation draws the same noise; the run's own random streams are untouched)."""
    top_k: int = 0
    """With temperature > 0: sample from the top_k most likely tokens only; 0 = off."""
    top_p: float = 1.0
    """With temperature > 0: nucleus sampling (after top_k); 1 = off; in (0, 1]."""

    def check(self) -> None:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.samples={self.samples} needs eval.temperature > 0: greedy decoding gives every sample of a prompt the same answer")
        if self.top_p > 1:
            raise ValueError(f"eval.top_p={self.top_p} must be <= 1: it is a share of the probability (1 = off)")


@dataclasses.dataclass
class TrainConfig:
    """The train engine."""

    BOUNDS: ClassVar[Bounds] = Bounds(
        at_least={"warmup_steps": 0, "micro_batch_size": 1, "max_tokens_per_micro_batch": 2, "weight_decay": 0, "threads": 0, "max_nonfinite_steps": 0, "lora_rank": 0},
        positive=("lr", "grad_clip", "lora_alpha"),
        why={"grad_clip": "gradients are clipped to this norm", "lora_alpha": "adapters are scaled by lora_alpha / lora_rank"},
    )

    backend: str = "torch"
    """Train adapter: torch (plain torch, one process) | fsdp (FSDP2, a process per placement.train instance) | deepspeed (DeepSpeed ZeRO, train.zero_stage; a process per placement.train instance) | megatron (megatron-core's GPTModel from a Qwen2 / Qwen3 / Llama / Mistral model, data parallel, MindSpeed on NPUs; a process per placement.train instance; padded micro-batches)."""
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
    lora_rank: int = 0
    """LoRA adapters of this rank train instead of every weight (peft; the `lora` extra): the base weights stay as loaded, AdamW's state is the adapters' only, a KL term's reference is the base with the adapters off, and rollout, evaluation, checkpoints and `tidal export` get the merged weights. The warm start (sft.steps) trains adapters too and merges them into the weights RL starts from; RL trains adapters of its own on those (a resumed run goes on with its checkpoint's base and adapters). 0 = every weight trains. train.backend torch, fsdp or deepspeed (ZeRO 1-3)."""
    lora_alpha: float = 16.0
    """LoRA scale: adapters add lora_alpha / lora_rank x B A to each adapted weight. > 0."""
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """Modules that take adapters, by name or its last part (q_proj, v_proj, ...); [all-linear] = every linear layer but the output head. Layers must be linear and own their weight (not a tied embedding)."""

    def check(self) -> None:
        from tidal.engines.lr_schedule import LR_SCHEDULES  # noqa: PLC0415

        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if not 0 <= self.min_lr_ratio <= 1:  # nan fails it too
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]: the cosine schedule's last lr as a share of train.lr")
        from tidal.engines.registry import LORA  # noqa: PLC0415

        if self.lora_rank and self.backend not in LORA:
            raise ValueError(f"train.lora_rank={self.lora_rank} needs train.backend {' or '.join(LORA)} (LoRA adapters); train.backend={self.backend} trains every weight: set train.lora_rank=0")
        if self.lora_rank and not self.lora_target_modules:
            raise ValueError("train.lora_target_modules is empty: name the modules that take adapters (q_proj, v_proj, ...), or [all-linear]")
        if self.zero_stage not in (1, 2, 3):  # `engines.deepspeed_setup.ZERO_STAGES`
            raise ValueError(f"train.zero_stage={self.zero_stage} is not one of 1, 2, 3 (DeepSpeed ZeRO: 1 shards the optimizer state, 2 also the gradients, 3 also the weights)")


@dataclasses.dataclass
class CriticConfig:
    """The critic of algorithm.advantage=gae (PPO with a learned value function): the policy's
    transformer body with a value head, copied from the policy as RL starts, trained where the
    policy trains on each step's returns: in the trainer's process (train.backend=torch,
    `engines.critic`) or over the trainer's ranks (fsdp and megatron, `engines.fsdp_critic`;
    deepspeed ZeRO-1 or -2, `engines.deepspeed_critic`), or another backend's (`backend`)."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"micro_batch_size": 1, "weight_decay": 0}, positive=("lr", "value_clip", "grad_clip"))

    backend: Optional[str] = None
    """Where the critic trains, as verl's critic.strategy may differ from the actor's: null = the train backend's own critic (torch: the trainer's process; fsdp and megatron: FSDP2 over the trainer's ranks; deepspeed: ZeRO-1/2 as train.zero_stage says) | torch | fsdp | deepspeed (a key of `engines.registry.CRITIC`). Beside a ZeRO-3 deepspeed policy set fsdp: the value model sharded with FSDP2 over the same ranks, as ZeRO-3 shards the policy."""
    path: Optional[str] = None
    """Local Hugging Face checkpoint directory the critic starts from instead of the policy: its transformer body, and for a one-label sequence-classification checkpoint (a reward model: OpenRLHF starts its critic from the reward model) its score head as the value head; it must read the policy's tokens (the same tokenizer vocabulary; model.source=hf). null = the policy, with a value head of zeros. A relative path is taken from where tidal run starts."""
    lr: float = 1e-5
    """AdamW's learning rate of the critic (verl's and OpenRLHF's default; a critic often learns faster than the policy)."""
    value_clip: Optional[float] = 0.5
    """PPO's value clipping (verl's cliprange_value): a value's loss stops pulling it once it is this far from the value the step's advantages used; null = no clipping."""
    micro_batch_size: Optional[int] = None
    """Rows per forward and backward pass of the critic; null = train.micro_batch_size."""
    grad_clip: float = 1.0
    """Largest norm of the critic's gradient."""
    weight_decay: float = 0.01
    """AdamW's weight decay of the critic."""


@dataclasses.dataclass
class NodeConfig:
    """Nodes of one shape in the cluster."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"count": 1})

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

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"count": 1, "devices_each": 1})

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

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"bucket_mb": 1})

    name: str = "auto"
    """auto | ipc | collective | host; auto picks from the two platforms: ipc on one node (any two CPU processes of it; CUDA only colocated), else collective for one vendor, else host (NPU <-> GPU, or a rollout whose environment has another torch build than the trainer's, as a vllm-ascend one does)."""
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

    def check(self) -> None:
        from tidal.hal.transfer import TRANSPORTS  # noqa: PLC0415 - imports torch; loading a recipe must not

        if self.name not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport.name={self.name!r} is not one of auto, {', '.join(TRANSPORTS)}")


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

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"rollout_restarts": 0, "trainer_restarts": 0, "liveness_s": 0, "liveness_grace_s": 0})

    rollout_restarts: int = 3
    """How many times Ray restarts each dead rollout actor; it takes the current weights and continues, and the prompts it held are generated again."""
    trainer_restarts: int = 1
    """How many times a dead trainer actor is started again; it resumes from the run's last checkpoint (weights, optimizer, data, store)."""
    liveness_s: float = 30.0
    """How long a rollout actor or trainer rank may answer no ping (stopped, hung, its machine swapping) before tidal warns, naming it and how long it has been silent (`silent_rollouts` in the metrics counts rollout actors'); 0 turns the checks off."""
    liveness_grace_s: float = 60.0
    """How much longer a silent actor may stay silent before it is killed and handled as a death: restarted, and counted against `rollout_restarts` or `trainer_restarts`."""


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases logging of each step's metrics (off unless `project` is set)."""

    project: Optional[str] = None
    """W&B project to log to; null = no W&B logging. Needs the wandb package (the `[wandb]` extra) and, online, `wandb login` or WANDB_API_KEY where the trainer runs (under `runtime: ray`, trainer rank 0's node)."""
    entity: Optional[str] = None
    """W&B team or user the project belongs to; null = the logged-in user's default."""
    name: Optional[str] = None
    """The W&B run's display name; null = the run directory's name."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Tags of the W&B run."""
    mode: Optional[WandbMode] = None
    """online | offline | disabled; null = wandb's own choice (WANDB_MODE, else online). Offline runs are written under run_dir/wandb for `wandb sync`."""


@dataclasses.dataclass
class RecipeConfig:
    """A tidal recipe: what to run, on which platform, and where its files go."""

    BOUNDS: ClassVar[Bounds] = Bounds(at_least={"seed": 0, "threads": 0, "checkpoint_every": 1, "keep_checkpoints": 0, "eval_every": 0}, positive=("lease_s",))

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
    """Also measure held-out accuracy (as before and after RL: greedy, unless `eval` says otherwise) every this many RL steps, with the trainer's weights of that step, while training waits: the `held_out_accuracy` field of that step's metrics.jsonl line and points in progress.png. 0 = only before and after RL."""
    keep_checkpoints: int = 0
    """How many of the newest checkpoints to keep; older ones are deleted once a newer one is complete. 0 = keep all."""
    lease_s: float = 3600.0
    """Seconds a stage may hold rows it took from the store before they are handed out again.
    Must outlast any generation and two train steps; a stage that dies gives its rows back
    at once, so this only frees rows that a hung one holds."""
    tensorboard: bool = True
    """Also write each step's metrics as TensorBoard scalars to run_dir/tensorboard, when the tensorboard package is installed."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging (with `wandb.project`): every number of each step's metrics, the held-out accuracies, and the resolved config. A resumed run continues its W&B run."""
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
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    """A reward model scoring each response, beside the task's reward."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """Supervised warm start."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation's decoding."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout engine."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Train engine."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """The value model of algorithm.advantage=gae."""
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

    @property
    def critic_backend(self) -> str:
        """The backend whose critic algorithm.advantage=gae trains: critic.backend, else train.backend."""
        return self.critic.backend or self.train.backend

    def check(self) -> None:
        """What spans sections, or needs a registry: the device, the seed's bound, the
        overlong buffer within the token budget, the loss's bounds, registered names, the
        data files' keys, and that the tiny model holds the longest sequence."""
        from tidal.engines.data import DataError, check_config  # noqa: PLC0415
        from tidal.engines.registry import CHECKED_ON_LOAD, unknown  # noqa: PLC0415
        from tidal.hal.select import check_spec  # noqa: PLC0415

        check_spec(self.device, source="device")
        if self.seed > MAX_SEED:
            raise ValueError(f"seed={self.seed} must be <= {MAX_SEED}: torch's generators take a 64-bit seed")
        check_overlong(self.algorithm, self.rollout)
        loss_config(self)  # every bound of the loss, now rather than after the warm start
        for key in CHECKED_ON_LOAD:
            section, _, field = key.partition(".")
            if message := unknown(key, getattr(getattr(self, section), field)):
                raise ValueError(message)
        try:
            check_config(self.data)
        except DataError as e:
            raise ValueError(str(e)) from None
        if self.model.source == "tiny" and not self.data.train_files:  # the case whose longest sequence is known before any file is read
            check_lengths(self)


_LOSS_KEYS = {"max_tokens": "rollout.max_new_tokens", "proximal_is_policy": "algorithm.decoupled"}
"""`PolicyLossConfig` fields whose recipe key is not `algorithm.<field>`."""


def loss_error(error: ValueError) -> ConfigError:
    """`PolicyLossConfig`'s `error` as a `ConfigError` that names recipe keys: each field it
    names becomes that field's key (`algorithm.<field>`, or `_LOSS_KEYS`'), and Python's
    None the recipe's null."""
    from tidal.flow.algorithms import PolicyLossConfig  # noqa: PLC0415 - imports torch; loading a recipe must not

    fields = re.compile(r"\b(" + "|".join(f.name for f in dataclasses.fields(PolicyLossConfig)) + r")\b")
    message = fields.sub(lambda m: _LOSS_KEYS.get(m[1], f"algorithm.{m[1]}"), str(error))
    return ConfigError(re.sub(r"\bNone\b", "null", message))


def loss_config(cfg: RecipeConfig) -> Any:
    """The recipe's policy loss (`flow.algorithms.PolicyLossConfig`, `AlgorithmConfig.loss`).

    Raises:
        ConfigError: naming the recipe key whose value the loss refuses.
    """
    try:
        return cfg.algorithm.loss(cfg.rollout.max_new_tokens)
    except ValueError as e:  # the loss names its fields: clip_low, clip_high, ...
        raise loss_error(e) from None


def longest_prompt(cfg: RecipeConfig) -> int | None:
    """Tokens of the longest prompt the recipe's task can draw, <bos> included (the
    character tokenizer: a token per character); None for a task without a known bound."""
    keys = tasks.PROMPT_PARAMS.get(cfg.task.name, ())
    chars = tasks.longest_prompt(cfg.task.name, {k: getattr(cfg.task, k) for k in keys})
    return None if chars is None else 1 + chars


def check_lengths(cfg: RecipeConfig) -> None:
    """`model.max_positions` holds the longest sequence: the longest prompt and every token rollout may add.

    Raises:
        ValueError: naming the keys that set each length.
    """
    prompt = longest_prompt(cfg)
    if prompt is None:
        return
    budget, limit = cfg.rollout.max_new_tokens, cfg.model.max_positions
    if prompt + budget > limit:
        keys = ", ".join(f"task.{k}={getattr(cfg.task, k)}" for k in tasks.PROMPT_PARAMS[cfg.task.name])
        raise ValueError(
            f"model.max_positions={limit} is shorter than the longest sequence: {prompt} prompt tokens (<bos> and the longest {cfg.task.name} prompt, {keys}) "
            f"+ rollout.max_new_tokens={budget} = {prompt + budget} tokens; raise model.max_positions or lower one of the others"
        )
