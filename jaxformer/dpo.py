"""Direct preference optimisation: a policy learns from pairs of answers to a prompt, one
preferred (`chosen`, y_w) and one not (`rejected`, y_l), against a frozen reference.

The policy's implicit reward of an answer is `r(y) = beta * (log pi(y|x) - log pi_ref(y|x))`,
each log-probability the sum over the answer's tokens (`sequence_logps`). The sigmoid loss is
the negative log-likelihood of the preference under Bradley-Terry,

    loss = -log sigmoid(r(y_w) - r(y_l)),

averaged over the pairs. While the policy is the reference both rewards are 0 and each pair's
loss is exactly `ln 2` (their float32 mean too, over at most 12 pairs: past that the sum
rounds). What TRL logs beside it (`dpo_metrics`): the mean rewards of the chosen and the
rejected answers, the share of pairs whose chosen reward is higher (accuracy), their mean
margin, and the policy's mean log-probabilities of each.

The reference is the model before training: with LoRA the same base with its adapters off (no
second copy of the weights); with every parameter trained, its log-probabilities computed once
before training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.losses import chunked_token_logps
from jaxformer.text.dataset import IGNORE

# What `dpo_metrics` returns beside the loss, as TRL names them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(model: nn.Module, variables: dict, tokens: jax.Array, targets: jax.Array, **apply) -> jax.Array:
    """`sum_t log p(targets[r, t] | tokens[r, :t + 1])` over each row's scored targets (not
    `IGNORE`): float32 `[rows]`, from the final hidden states a chunk of positions at a time
    (`chunked_token_logps`), never the whole logits.

    Args:
      model: a `Decoder` (its `output_head` reads `variables["params"]`).
      variables: what it applies with.
      tokens, targets: `[rows, T]` inputs and next ids (`IGNORE` where not scored).
      **apply: passed to `model.apply` (`rngs` for dropout).
    """
    hidden, _ = model.apply(variables, tokens, hidden=True, **apply)  # [rows, T, d_model]
    head = model.output_head(variables["params"])
    return chunked_token_logps(hidden, targets, head, ignore_id=IGNORE).sum(-1)  # [rows]


def dpo_terms(logps: jax.Array, ref_logps: jax.Array, beta: float) -> dict[str, jax.Array]:
    """Each pair's loss and rewards.

    Args:
      logps, ref_logps: float `[2 B]` sequence log-probabilities under the policy and the
        reference, the chosen answers' first, then the rejected answers' (in the same order).
      beta: the reward's scale, > 0.

    Returns:
      `loss`, `chosen`, `rejected` (the rewards `beta * (log pi - log pi_ref)`), each float32 `[B]`.
    """
    chosen, rejected = jnp.split(beta * (logps - ref_logps).astype(jnp.float32), 2)  # [B] each
    # -log sigmoid(z) as softplus(-z): exact for large |z| where log(sigmoid(z)) underflows.
    return {"loss": jax.nn.softplus(-(chosen - rejected)), "chosen": chosen, "rejected": rejected}


def dpo_metrics(logps: jax.Array, ref_logps: jax.Array, beta: float,
                weights: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss, metrics)`: the mean loss over the pairs and `METRICS`, as TRL logs them.

    Args:
      logps, ref_logps, beta: as `dpo_terms`'.
      weights: float `[B]`, each pair's weight in the means (0 for a batch's filler pairs), or
        None for all alike. (A mean over a split of several batches: `dpo_sums` of each.)
    """
    sums, count = dpo_sums(logps, ref_logps, beta, weights)
    means = {name: total / jnp.maximum(count, 1.0) for name, total in sums.items()}
    return means.pop("loss"), means


def dpo_sums(logps: jax.Array, ref_logps: jax.Array, beta: float,
             weights: jax.Array | None = None) -> tuple[dict[str, jax.Array], jax.Array]:
    """The weighted sums over the pairs of the loss and of each of `METRICS`, and the weights'
    sum: a split's means are its batches' sums added, over their counts added. (In float32: a
    sum of more than 12 losses of exactly ln 2 rounds; `dpo_per_pair`'s values summed in float64
    do not.)"""
    per_pair = dpo_per_pair(logps, ref_logps, beta)
    weights = jnp.ones_like(per_pair["loss"]) if weights is None else weights.astype(jnp.float32)
    return {name: jnp.sum(weights * value) for name, value in per_pair.items()}, jnp.sum(weights)


def dpo_per_pair(logps: jax.Array, ref_logps: jax.Array, beta: float) -> dict[str, jax.Array]:
    """Each pair's loss and `METRICS` (its accuracy 1.0 or 0.0), float32 `[B]` each."""
    terms = dpo_terms(logps, ref_logps, beta)
    policy_chosen, policy_rejected = jnp.split(logps.astype(jnp.float32), 2)
    return {"loss": terms["loss"], "rewards/chosen": terms["chosen"], "rewards/rejected": terms["rejected"],
            "rewards/accuracies": (terms["chosen"] > terms["rejected"]).astype(jnp.float32),
            "rewards/margins": terms["chosen"] - terms["rejected"],
            "logps/chosen": policy_chosen, "logps/rejected": policy_rejected}
