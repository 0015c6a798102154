"""tidal.flow.algorithms: advantage estimators and policy losses as pure tensor functions.

Nothing here knows about devices, engines or the store: every function takes tensors and
returns tensors on the same device, so the trainer can call them wherever its model runs.
`ADVANTAGES` maps recipe names to estimators (`silent_groups` finds the groups they give no
signal; `gae` holds PPO's value-based ones, for a critic); `policy_loss` with a `PolicyLossConfig`
covers PPO-clip, dual-clip, decoupled PPO, truncated IS, sequence masking, GSPO, KL and
entropy terms (`token_entropy` gives the entropy from log-probabilities); `overlong`
handles responses cut at the token budget (DAPO's filter and soft penalty).
"""

from tidal.flow.algorithms.advantages import ADVANTAGES, TOKEN_WHITENED, VALUE_BASED, compute_advantages, dr_grpo, grpo, rloo, silent_groups, token_whiten
from tidal.flow.algorithms.gae import KLController, explained_variance, gae, kl_penalty_rewards, masked_whiten, value_loss
from tidal.flow.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LEVELS,
    PolicyLossConfig,
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
    sequence_keep,
    token_entropy,
)
from tidal.flow.algorithms.overlong import OVERLONG, filter_truncated, overlong_penalty

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "KLController",
    "LEVELS",
    "OVERLONG",
    "PolicyLossConfig",
    "TOKEN_WHITENED",
    "VALUE_BASED",
    "aggregate",
    "compute_advantages",
    "dr_grpo",
    "explained_variance",
    "filter_truncated",
    "gae",
    "grpo",
    "kl_estimate",
    "kl_penalty_rewards",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "rloo",
    "sequence_keep",
    "silent_groups",
    "token_entropy",
    "token_whiten",
]
