"""Learning-rate schedules as optax schedules: the 2017 paper's ("Noam") and warm-up + cosine.

An optax schedule is the learning rate itself, not a multiplier of a base rate
(docs/training.md, "Schedules").
"""

import jax.numpy as jnp
import optax

from jaxformer.validation import as_float, as_int


def noam_schedule(d_model: int, warmup_steps: int, factor: float = 1.0) -> optax.Schedule:
    """The paper's rate, `factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`.

    optax counts updates from 0 and the paper from 1, so the formula reads `step = count + 1`
    (clamped to >= 1, keeping a direct call with a count below 0 finite).

    Args:
      d_model: the model width, an int >= 1.
      warmup_steps: steps of linear warm-up, an int >= 1.
      factor: a finite number > 0 scaling the whole curve.

    Returns:
      A function `count -> lr`, float32, safe on traced counts.

    Raises:
      ValueError: an argument outside the limits above.
    """
    d_model = as_int(d_model, "noam_schedule d_model", minimum=1)
    warmup_steps = as_int(warmup_steps, "noam_schedule warmup_steps", minimum=1)
    factor = as_float(factor, "noam_schedule factor", above=0)
    # The constant parts, in Python float64; they enter the traced math as weak-typed scalars.
    scale = factor * float(d_model) ** -0.5
    warmup_slope = float(warmup_steps) ** -1.5  # the warm-up branch is step * warmup^-1.5

    def schedule(count):
        # optax's 0-based count of applied updates -> the paper's 1-based step, clamped at 1.
        step = jnp.maximum(jnp.asarray(count, jnp.float32) + 1.0, 1.0)  # []
        return scale * jnp.minimum(step ** -0.5, step * warmup_slope)  # []

    return schedule


def warmup_cosine_schedule(peak_lr: float, warmup_steps: int, total_steps: int,
                           final_fraction: float = 0.1) -> optax.Schedule:
    """Linear warm-up to `peak_lr`, then a cosine down to `final_fraction * peak_lr` at `total_steps`.

    Args:
      peak_lr: the rate at the end of warm-up, a finite number > 0.
      warmup_steps: steps of warm-up, an int >= 1.
      total_steps: the step at which the cosine reaches its floor, an int >= warmup_steps.
      final_fraction: the floor as a fraction of the peak, in [0, 1].

    Returns:
      A function `count -> lr`, float32, safe on traced counts.

    Raises:
      ValueError: an argument outside the limits above.
    """
    peak_lr = as_float(peak_lr, "warmup_cosine_schedule peak_lr", above=0)
    warmup_steps = as_int(warmup_steps, "warmup_cosine_schedule warmup_steps", minimum=1)
    total_steps = as_int(total_steps, "warmup_cosine_schedule total_steps", minimum=warmup_steps,
                         minimum_name="warmup_steps")
    final_fraction = as_float(final_fraction, "warmup_cosine_schedule final_fraction", at_least=0, maximum=1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)  # []
        warm = peak_lr * (count + 1.0) / warmup_steps  # [] count < warmup: peak * (count + 1) / warmup
        # t in [0, 1] over the decay; lr = peak * (f + (1 - f) * (1 + cos(pi t)) / 2)
        t = jnp.clip((count - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)  # []
        cosine = peak_lr * (final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * t)))  # []
        return jnp.where(count < warmup_steps, warm, cosine)  # []

    return schedule
