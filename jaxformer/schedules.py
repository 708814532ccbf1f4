"""The learning-rate schedule of "Attention Is All You Need" (the "Noam" schedule).

    lr(step) = factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

The rate rises linearly for the first `warmup_steps` steps and then decays as the
inverse square root of the step. The two branches of the `min` meet at
`step == warmup_steps`, where the rate peaks at `factor * (d_model * warmup_steps)^-0.5`.
The paper trains with Adam (b1 = 0.9, b2 = 0.98, eps = 1e-9), d_model = 512, 4000
warmup steps and factor 1.
"""

import jax.numpy as jnp
import optax

from jaxformer.validation import as_float, as_int


def noam_schedule(d_model: int, warmup_steps: int, factor: float = 1.0) -> optax.Schedule:
    """The paper's learning rate, as an optax schedule.

    The schedule is the learning rate itself, not a multiplier of some base rate:

        schedule = noam_schedule(d_model=512, warmup_steps=4000)
        optimizer = optax.adam(learning_rate=schedule, b1=0.9, b2=0.98, eps=1e-9)

    Step numbering: the paper counts steps from 1; optax calls the schedule with the
    number of updates already applied, 0 for the first update. The schedule therefore
    evaluates the formula at `step = count + 1`, so the first update uses the paper's
    step 1 and update `warmup_steps - 1` (0-based) is the peak. `step` is also clamped
    to `>= 1`: for the counts optax passes (`>= 0`) the clamp never triggers, but it
    keeps a direct call with any count (0, or a negative one) finite instead of
    dividing by zero in `step^-0.5`. (The reference's `LambdaLR` calls its lambda with
    0 for the first update and clamps it to 1, so it spends two updates at step 1: its
    rates are this schedule's, one update later.)

    The PyTorch pitfall this avoids: `torch.optim.lr_scheduler.LambdaLR` multiplies the
    optimizer's base lr by the lambda. Porting the formula into a lambda while giving the
    optimizer `lr=0` trains with lr 0 forever; the loss still wiggles from dropout, which
    hides that nothing is learned (such a port needs base lr 1). In optax the schedule's
    value is the rate that scales each update, so there is no base lr to get wrong.

    Args:
      d_model: the model width, an int >= 1.
      warmup_steps: steps of linear warm-up, an int >= 1.
      factor: a finite number > 0 scaling the whole curve.

    Returns:
      A function `count -> lr`, float32, safe on traced int counts (inside `jit`).

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
    """Linear warm-up to `peak_lr`, then a cosine down to `final_fraction * peak_lr`.

        count < warmup:  lr = peak * (count + 1) / warmup
        otherwise:       lr = peak * (f + (1 - f) * (1 + cos(pi * t)) / 2),
                         t = (count - warmup) / max(1, total - warmup), clipped to [0, 1]

    (the reference decoder-only demo's schedule, with optax's 0-based count as its step).

    Args:
      peak_lr: the rate at the end of warm-up, a finite number > 0.
      warmup_steps: steps of warm-up, an int >= 1.
      total_steps: the step at which the cosine reaches its floor, an int >= warmup_steps.
      final_fraction: the floor as a fraction of the peak, in [0, 1].

    Returns:
      A function `count -> lr` (float32, jit-safe).

    Raises:
      ValueError: an argument outside the limits above.
    """
    peak_lr = as_float(peak_lr, "warmup_cosine_schedule peak_lr", above=0)
    warmup_steps = as_int(warmup_steps, "warmup_cosine_schedule warmup_steps", minimum=1)
    total_steps = as_int(total_steps, "warmup_cosine_schedule total_steps", minimum=warmup_steps,
                         minimum_name="warmup_steps")
    final_fraction = as_float(final_fraction, "warmup_cosine_schedule final_fraction", at_least=0, maximum=1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak_lr * (count + 1.0) / warmup_steps
        t = jnp.clip((count - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)
        cosine = peak_lr * (final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * t)))
        return jnp.where(count < warmup_steps, warm, cosine)

    return schedule
