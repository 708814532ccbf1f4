"""GRPO's objective (group relative policy optimisation: DeepSeekMath, DeepSeek-R1): each prompt's
completions are scored against one another rather than against a learned value function.

A prompt is sampled `G` times (`group_size`); completion `i` earns a reward `r_i`, and its
advantage is its reward standardised within its group (`group_advantages`),

    A_i = (r_i - mean_j r_j) / (std_j r_j + 1e-4),

the standard deviation the unbiased one (divisor `G - 1`), as TRL computes it (its
`scale_rewards="group"`) and `torch.std` does. Every token of completion `i` shares `A_i`.

The policy `pi` is then moved to maximise the clipped surrogate of PPO less a KL penalty towards a
reference policy `pi_ref`, the paper's objective (TRL's `loss_type="grpo"`; `grpo_loss` returns
its negative, a loss):

    J = 1/B sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i) - beta KL_it ],

over the `B` completions `o_i` of the batch and their `|o_i|` tokens `t`, with

    rho_it = pi(o_it) / pi_old(o_it) = exp(logp_it - old_logp_it),
    KL_it  = pi_ref(o_it) / pi(o_it) - log(pi_ref(o_it) / pi(o_it)) - 1   (the k3 estimator, >= 0),

`pi_old` the policy that sampled the completions. Each completion counts equally, whatever its
length: its tokens' terms are averaged first (`1/|o_i|`), then the completions'. `pi_old` and
`pi_ref` are constants: the gradient flows through `logp` alone. The clip takes effect (the
gradient of a token vanishes) where `rho < 1 - eps` with `A < 0`, or `rho > 1 + eps` with `A > 0`:
the update has already moved that token's probability as far as the surrogate allows.
"""

import jax
import jax.numpy as jnp

from jaxformer.validation import as_float, as_int

STD_EPS = 1e-4  # added to a group's standard deviation: a group of equal rewards gets A = 0, not 0 / 0

__all__ = ["STD_EPS", "group_advantages", "grpo_loss"]


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Each completion's reward standardised within its prompt's group:
    `A_i = (r_i - mean_group) / (std_group + 1e-4)`, the standard deviation unbiased
    (divisor `group_size - 1`), as TRL computes it.

    Args:
      rewards: float `[n]`, `n = prompts * group_size`: each run of `group_size` consecutive
        rewards is one prompt's completions'.
      group_size: completions per prompt, at least 2 (one completion has no spread to scale by).

    Returns:
      float32 `[n]`, the advantages in `rewards`' order; exactly 0 throughout a group whose
      rewards are all equal.

    Raises:
      ValueError: `group_size` below 2 or not dividing `n`, or `rewards` not 1-D numbers.
    """
    group_size = as_int(group_size, "group_advantages group_size", minimum=2)
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1 or not (jnp.issubdtype(rewards.dtype, jnp.integer)
                                 or jnp.issubdtype(rewards.dtype, jnp.floating)):
        raise ValueError(f"group_advantages: rewards must be a 1-D array of numbers [n], "
                         f"got shape {rewards.shape}, dtype {rewards.dtype}")
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(f"group_advantages group_size must divide the number of rewards n={n} "
                         f"(n = prompts * group_size) (got {group_size})")
    r = rewards.astype(jnp.float32).reshape(n // group_size, group_size)  # [prompts, G]
    # Centred on the group's first reward before the mean: the same r - mean, but a group of equal
    # rewards gives exactly 0 - 0 (a float32 mean of G equal values may differ from them by a
    # rounding, which / 1e-4 would turn into a visible advantage).
    shifted = r - r[:, :1]  # [prompts, G]
    centred = shifted - jnp.mean(shifted, axis=1, keepdims=True)  # [prompts, G] r_i - mean_group
    std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))  # [prompts, 1] ddof=1
    return (centred / (std + STD_EPS)).reshape(n)  # [n]


def grpo_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, *, epsilon: float, beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`-J`, GRPO's clipped objective with its KL penalty (the module's formula), and two figures
    to watch, as TRL computes them for `loss_type="grpo"`.

    Positions outside `mask` count for nothing whatever they hold: their log-probabilities are
    replaced by 0 before use, so even NaN or inf there (a padding's) leaves the loss and its
    gradient finite.

    Args:
      logps: float `[B, T]`, `log pi(o_it)` under the policy being trained: the log-probability of
        each completion token (any float dtype; the loss runs in float32). The gradient flows
        through these alone.
      old_logps: float `[B, T]`, the same under the policy that sampled the completions (equal to
        `logps` on the first update of a batch, where the ratio is 1). A constant.
      ref_logps: float `[B, T]`, the same under the reference policy, a constant; or None where
        `beta` is 0.
      advantages: float `[B]`, each completion's `A_i` (`group_advantages`).
      mask: bool `[B, T]`, True at the completion's tokens (not the prompt's, not padding).
      epsilon: the clip range `eps`, > 0 (TRL's and the paper's default: 0.2).
      beta: the KL penalty's weight, >= 0; 0 drops the penalty.

    Returns:
      `(loss, metrics)`: `loss` a float32 scalar, the mean over the `B` completions of each one's
      masked mean of `-min(rho A, clip(rho) A) + beta KL` (a completion without tokens adds 0 and
      still counts in the mean); `metrics` float32 scalars:
        "kl": the mean of `KL_it` over every masked token of the batch, 0.0 without `ref_logps`
          (reported also at `beta` 0 when `ref_logps` is given);
        "clip_ratio": the fraction of masked tokens where the clip takes effect, `(rho < 1 - eps
          and A < 0) or (rho > 1 + eps and A > 0)`.
      Both are 0.0 when no token is masked in.

    Raises:
      ValueError: `epsilon` not > 0, `beta` not >= 0, `ref_logps` None with `beta` > 0, or
        shapes and dtypes other than the above.
    """
    epsilon = as_float(epsilon, "grpo_loss epsilon", above=0)
    beta = as_float(beta, "grpo_loss beta", at_least=0)
    logps, old_logps, advantages, mask = (jnp.asarray(x) for x in (logps, old_logps, advantages, mask))
    ref_logps = None if ref_logps is None else jnp.asarray(ref_logps)
    _check_inputs(logps, old_logps, ref_logps, advantages, mask, beta)

    def masked(x):  # float32 [B, T], 0 outside the mask: a padding's NaN never reaches the sums
        return jnp.where(mask, x.astype(jnp.float32), 0.0)

    logp = masked(logps)  # [B, T] log pi
    old = jax.lax.stop_gradient(masked(old_logps))  # [B, T] log pi_old, a constant
    a = advantages.astype(jnp.float32)[:, None]  # [B, 1] A_i, shared by the tokens of o_i

    ratio = jnp.exp(logp - old)  # [B, T] rho = pi / pi_old
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a)  # [B, T]
    per_token = -surrogate  # [B, T] a loss: minimised where J is maximised
    if ref_logps is None:
        kl_mean = jnp.zeros((), jnp.float32)
    else:
        log_ref_ratio = jax.lax.stop_gradient(masked(ref_logps)) - logp  # [B, T] log(pi_ref / pi)
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1  # [B, T] k3: pi_ref/pi - log(pi_ref/pi) - 1
        if beta > 0:
            per_token = per_token + beta * kl  # [B, T] the penalty, -(-beta KL)
        kl_mean = _batch_mean(kl, mask)

    tokens = jnp.maximum(jnp.sum(mask, axis=1), 1).astype(jnp.float32)  # [B] |o_i|, 1 for an empty row (0 / 1)
    per_sequence = jnp.sum(jnp.where(mask, per_token, 0.0), axis=1) / tokens  # [B] 1/|o_i| sum_t
    loss = jnp.mean(per_sequence)  # [] 1/B sum_i

    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))  # [B, T] the clip's branch
    metrics = {"kl": kl_mean, "clip_ratio": _batch_mean(clipped.astype(jnp.float32), mask)}
    return loss, metrics


def _batch_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """float32 `[]`: the mean of `x` `[B, T]` over every masked token of the batch, 0.0 with none."""
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def _check_inputs(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
                  mask: jax.Array, beta: float) -> None:
    """Raises, naming the argument, unless the log-probabilities are float `[B, T]` alike,
    `advantages` float `[B]`, `mask` bool `[B, T]`, and `ref_logps` is given where `beta` > 0.
    Shapes and dtypes only: traced arrays are checked too."""
    if ref_logps is None and beta > 0:
        raise ValueError(f"grpo_loss ref_logps must be given when beta > 0: the KL penalty needs the "
                         f"reference's log-probabilities (got None with beta={beta:g})")
    if logps.ndim != 2 or logps.shape[0] < 1:
        raise ValueError(f"grpo_loss logps must be 2-D [B, T] with B >= 1, got shape {logps.shape}")
    shape = logps.shape  # (B, T)
    given = {"logps": logps, "old_logps": old_logps, "ref_logps": ref_logps}
    for name, x in given.items():
        if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.floating)):
            raise ValueError(f"grpo_loss {name} must be float [B, T] = {list(shape)} like logps, "
                             f"got shape {x.shape}, dtype {x.dtype}")
    if advantages.shape != shape[:1] or not jnp.issubdtype(advantages.dtype, jnp.floating):
        raise ValueError(f"grpo_loss advantages must be float [B] = [{shape[0]}], one per completion, "
                         f"got shape {advantages.shape}, dtype {advantages.dtype}")
    if mask.shape != shape or mask.dtype != jnp.bool_:
        raise ValueError(f"grpo_loss mask must be bool [B, T] = {list(shape)}, True at completion tokens, "
                         f"got shape {mask.shape}, dtype {mask.dtype}")
