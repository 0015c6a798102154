"""The recipe sections the RL loop reads: `rollout` and `algorithm`.

They are sections of the typed recipe schema (`tidal.tools.config.RecipeConfig`, which
takes them from here: the schema is their one declaration) and what `WorkflowConfig`
holds, so the loop and the recipe cannot drift apart. Every field has a docstring (the
string literal under it), which `tidal config --keys` prints.

A section carries its own checks, run when a recipe loads: its fields' bounds (`Bounded`)
and, for what a bound cannot say, a `check()` that raises `ValueError` naming the recipe
key (`Checked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tidal.flow.algorithms import PolicyLossConfig


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Bounds on a section's numeric fields, by field name."""

    at_least: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """The smallest valid value (a null value passes)."""
    positive: tuple[str, ...] = ()
    """Fields that must be > 0 when set."""
    finite: tuple[str, ...] = ()
    """Fields with no other bound here that must be finite when set (every bounded one must be)."""
    why: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Why a field is bounded, added to its error."""


@runtime_checkable
class Bounded(Protocol):
    """A recipe section whose numeric fields have bounds."""

    BOUNDS: ClassVar[Bounds]


@runtime_checkable
class Checked(Protocol):
    """A recipe section with checks beyond its types and bounds."""

    def check(self) -> None:
        """Raises ValueError naming the recipe key (`section.field=value`) that is wrong and why."""


@dataclasses.dataclass
class RolloutConfig:
    """The rollout engine."""

    BOUNDS: ClassVar[Bounds] = Bounds(
        at_least={"max_new_tokens": 1, "chunk_tokens": 1, "prompts_per_generate": 1, "threads": 0, "max_model_len": 1, "top_k": 0},
        positive=("temperature", "gpu_memory_utilization", "top_p"),
        why={"temperature": "rollout samples, and its behavior logprobs are taken at this temperature", "top_k": "0 turns it off (verl's and vLLM's -1)"},
    )

    backend: str = "hf"
    """Rollout adapter: hf (a transformers model sampled with a KV cache, any platform), vllm
    (vLLM's engine on GPUs, vllm-ascend's on NPUs; the `[vllm]` extra, loads `model.path`,
    tensor parallel over `placement.rollout.devices_each`)."""
    temperature: float = 1.0
    """Sampling temperature (behavior logprobs are computed at it)."""
    top_k: int = 0
    """Sample from the top_k most likely tokens only (after the temperature; ties with the k-th kept); 0 = off (verl's -1). The trainer takes its logprobs under the same cut, so the policy it trains is the one rollout samples from (with the same weights the importance ratio stays 1)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of most likely tokens whose probability reaches top_p (after top_k); 1 = off; in (0, 1]. Like top_k, the trainer's logprobs are taken under the same cut."""
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
    gpu_memory_utilization: float = 0.6
    """backend vllm: share of each device's memory vLLM takes for weights and KV cache (0 < x <= 1)."""
    max_model_len: Optional[int] = None
    """backend vllm: longest sequence (prompt + response) it serves; null = the checkpoint's."""
    enforce_eager: bool = False
    """backend vllm: no CUDA/NPU graphs (slower decoding, faster start, less memory)."""

    def check(self) -> None:
        if self.top_p > 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be <= 1: it is a share of the probability (1 = off)")
        if self.gpu_memory_utilization > 1:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be <= 1: it is a share of each device's memory")


@dataclasses.dataclass
class AlgorithmConfig:
    """The RL algorithm and its staleness bound."""

    BOUNDS: ClassVar[Bounds] = Bounds(
        at_least={"num_steps": 1, "prompts_per_step": 1, "group_size": 1, "max_staleness": 0, "gamma": 0, "lam": 0, "clip_low": 0, "clip_high": 0, "kl_coef": 0, "kl_in_reward": 0, "kl_horizon": 1, "overlong_buffer": 0, "max_filtered_in_a_row": 1, "critic_warmup": 0},
        positive=("tis_cap", "seq_mask_high", "kl_target"),
        finite=("seq_mask_low", "dual_clip", "entropy_coef"),
        why={
            "tis_cap": "the importance weight is truncated at it; null for no cap",
            "seq_mask_high": "sequences whose behavior weight is above it are left out, and every weight is > 0, so all would be; null for no upper bound",
        },
    )

    num_steps: int = 30
    """Optimizer steps of RL."""
    prompts_per_step: int = 8
    """Prompts per optimizer step."""
    group_size: int = 8
    """Samples per prompt (GRPO group); >= 2, except with advantage=gae (the critic is the baseline: 1 is PPO's usual)."""
    max_staleness: int = 1
    """A sample from version v is trainable by versions v .. v + max_staleness; 0 = synchronous on-policy."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | grpo_no_std | rloo | dr_grpo | reinforce_plus_plus_baseline (REINFORCE++-baseline, verl's name; OpenRLHF's reinforce_baseline: the reward minus its group's mean, whitened over each step's loss tokens, the batch's std in place of the group's) | gae (PPO with a learned value function: a critic, the `critic` section, gives each token's value, and the advantages are generalized advantage estimates with `gamma` and `lam`, whitened over each step's loss tokens; train.backend torch, fsdp, megatron (the critic fsdp's) or deepspeed (under zero_stage 3 with critic.backend=fsdp))."""
    critic_warmup: int = 0
    """advantage=gae: the first this many RL steps train the critic alone (verl's trainer.critic_warmup, OpenRLHF's freezing_actor_steps), so the policy's first steps take advantages from values already fit to its rewards rather than from a new value head; in them the policy's weights, optimizer state and learning-rate schedule stay as they are, its version still counts the step (rollout goes on under the same weights) and the step's metrics have the critic's but no policy loss. 0 = none; < num_steps."""
    gamma: float = 1.0
    """advantage=gae: discount per token, in [0, 1] (verl's and OpenRLHF's default 1: the sequence's reward reaches every token undiscounted)."""
    lam: float = 1.0
    """advantage=gae: GAE's lambda, in [0, 1]: 1 = the return minus the value (unbiased, high variance), 0 = one-step TD (verl's and OpenRLHF's PPO default 1; 0.95 is common)."""
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
    """KL penalty to the initial (warm-started) policy, a frozen copy the train engine keeps (and checkpoints); 0 = none. Every train backend holds one (fsdp sharded as the policy; deepspeed partitioned under ZeRO-3, else whole on every rank as the policy is); with LoRA adapters (train.lora_rank) the reference is the base with the adapters off."""
    kl_in_reward: float = 0.0
    """advantage=gae: the coefficient of a KL penalty in the reward, as InstructGPT's, OpenRLHF's and TRL's PPO put it (verl's use_kl_in_reward with kl_ctrl.kl_coef): each response token's reward is -kl_in_reward x (behavior logprob - reference logprob), the sequence's reward added at its last token, against the frozen reference kl_coef uses (kept by the train engine; train.backend torch, fsdp, deepspeed or megatron); 0 = none. kl_coef puts the KL in the loss instead (GRPO's way); both may be set. Metrics: reward_kl, reward_kl_coef."""
    kl_target: Optional[float] = None
    """With kl_in_reward: the KL per token to steer toward by adapting the coefficient after each step (verl's kl_ctrl.type=adaptive with target_kl; Ziegler et al. 2019): it starts at kl_in_reward and moves by clip(kl / kl_target - 1, -0.2, 0.2) x samples / kl_horizon; null = a fixed coefficient. A resumed run goes on with the coefficient its checkpoint saved."""
    kl_horizon: int = 10000
    """With kl_target: the samples over which a KL off the target moves the coefficient by its (clipped) relative error (verl's kl_ctrl.horizon)."""
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

    filter_groups: bool = False
    """Dynamic sampling (DAPO; verl's algorithm.filter_groups): a group whose samples all got the same reward (after the overlong penalty), or whose rewards all failed but one, has every advantage 0 and no policy-gradient signal; it is left out of training, and rollout starts another prompt in its place, so each step trains prompts_per_step groups that carry signal (their share of a step no longer dilutes it). The `filtered_groups` metric counts them. Left-out groups add no KL or entropy term either (kl_coef, entropy_coef)."""
    max_filtered_in_a_row: Optional[int] = None
    """With filter_groups: how many groups may be left out one after another, with none kept between them, before the run stops with an error (every prompt solved, or none, or a reward that gives one value); null = 10 x prompts_per_step (verl's max_num_gen_batches=10). >= 1."""

    def check(self) -> None:
        """Each name key holds a known name."""
        from tidal.flow.algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, LEVELS, OVERLONG, VALUE_BASED  # noqa: PLC0415 - imports torch; loading a recipe must not

        for key, names in (("advantage", [*ADVANTAGES, *sorted(VALUE_BASED)]), ("aggregation", AGGREGATIONS), ("level", LEVELS), ("kl_estimator", KL_ESTIMATORS), ("overlong", OVERLONG)):
            if getattr(self, key) not in names:
                raise ValueError(f"algorithm.{key}={getattr(self, key)!r} is not one of {', '.join(names)}")
        for key in ("gamma", "lam"):
            if getattr(self, key) > 1:
                raise ValueError(f"algorithm.{key}={getattr(self, key)} must be <= 1")
        if self.kl_in_reward > 0 and self.advantage not in VALUE_BASED:
            raise ValueError(
                f"algorithm.kl_in_reward={self.kl_in_reward} puts a KL penalty into each token's reward, which only a critic's per-token advantages read "
                f"(advantage=gae); algorithm.advantage={self.advantage} reads one reward per sequence: set algorithm.kl_coef (the KL in the loss, GRPO's way) instead"
            )
        if self.kl_target is not None and self.kl_in_reward == 0:
            raise ValueError(f"algorithm.kl_target={self.kl_target} adapts the coefficient of a KL penalty in the reward, and algorithm.kl_in_reward is 0: set it (the coefficient to start from), or unset kl_target")
        if self.advantage not in VALUE_BASED and self.group_size < 2:
            raise ValueError(
                f"algorithm.group_size={self.group_size} must be >= 2: algorithm.advantage={self.advantage} compares a prompt's samples with each other, "
                "so one sample learns nothing (advantage=gae, whose critic is the baseline, learns from one)"
            )
        if self.critic_warmup and self.advantage not in VALUE_BASED:
            raise ValueError(f"algorithm.critic_warmup={self.critic_warmup} trains a critic alone, and algorithm.advantage={self.advantage} has none: set algorithm.advantage=gae, or critic_warmup=0")
        if self.critic_warmup >= self.num_steps:
            raise ValueError(f"algorithm.critic_warmup={self.critic_warmup} must be < algorithm.num_steps ({self.num_steps}): the policy would never train")
        if self.advantage in VALUE_BASED and self.filter_groups:
            raise ValueError(f"algorithm.filter_groups leaves out groups whose rewards are all one, and algorithm.advantage={self.advantage} learns from them too (its critic is the baseline): unset one")

    @property
    def filtered_limit(self) -> int:
        """`max_filtered_in_a_row`, its null resolved."""
        return self.max_filtered_in_a_row if self.max_filtered_in_a_row is not None else 10 * self.prompts_per_step

    def loss(self, max_tokens: int) -> PolicyLossConfig:
        """The policy loss these keys describe, `max_tokens` the longest response
        (`rollout.max_new_tokens`; "token_sum_norm"'s constant). `proximal_is_policy` is
        left False: the workflow sets it for each step from `decoupled`.

        Raises:
            ValueError: from `PolicyLossConfig`, naming its field (the key of that name).
        """
        from tidal.flow.algorithms import PolicyLossConfig  # noqa: PLC0415 - imports torch; loading a recipe must not

        # every field but `max_tokens` (given) and `proximal_is_policy` (the workflow's) is the `algorithm` key of its name
        own = [f.name for f in dataclasses.fields(PolicyLossConfig) if f.name not in ("max_tokens", "proximal_is_policy")]
        return PolicyLossConfig(**{name: getattr(self, name) for name in own}, max_tokens=max_tokens)


def check_overlong(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """With `algorithm.overlong=penalty` the buffer lies within the token budget.

    Raises:
        ValueError: naming both keys.
    """
    if algorithm.overlong == "penalty" and not 1 <= algorithm.overlong_buffer <= rollout.max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer={algorithm.overlong_buffer} must be within 1..rollout.max_new_tokens ({rollout.max_new_tokens}) with algorithm.overlong=penalty: "
            "the tokens before the limit over which the penalty falls to -1"
        )
