"""The Noam schedule against the paper's formula, and driving a real optax.adam."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import import_peer

from jaxformer.schedules import noam_schedule


def _paper_lr(step, d_model, warmup, factor=1.0):
    """The paper's formula at its 1-based step, in Python float64."""
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def test_step_one_peak_and_four_times_warmup():
    schedule = noam_schedule(d_model=64, warmup_steps=400)
    first, peak, later = (float(schedule(count)) for count in (0, 399, 1599))  # paper steps 1, 400, 1600
    np.testing.assert_allclose(first, 64 ** -0.5 * 400 ** -1.5, rtol=1e-6)  # the warm-up branch at step 1
    np.testing.assert_allclose(peak, 6.25e-3, rtol=1e-6)  # 64^-0.5 * 400^-0.5 = 1/8 * 1/20
    np.testing.assert_allclose(later, 6.25e-3 / 2, rtol=1e-6)  # (4 w)^-0.5 = w^-0.5 / 2
    for count in (0, 1, 17, 398, 399, 400, 1599, 123_456):
        np.testing.assert_allclose(float(schedule(count)), _paper_lr(count + 1, 64, 400), rtol=1e-6)


def test_rises_to_the_peak_then_falls():
    warmup = 400
    schedule = noam_schedule(d_model=512, warmup_steps=warmup)
    lrs = np.asarray(jax.vmap(schedule)(jnp.arange(10 * warmup)))
    chex.assert_shape(lrs, (10 * warmup,))
    assert np.all(np.diff(lrs[:warmup]) > 0)  # counts 0 .. warmup-1: strictly rising
    assert np.all(np.diff(lrs[warmup - 1:]) < 0)  # from the peak on: strictly falling
    assert int(np.argmax(lrs)) == warmup - 1  # the peak is paper step warmup, count warmup - 1
    # The warm-up branch is linear in the step: lr(count) = (count + 1) * lr(0).
    np.testing.assert_allclose(lrs[:warmup], np.arange(1, warmup + 1) * lrs[0], rtol=1e-5)


def test_factor_scales_the_curve():
    counts = jnp.array([0, 10, 99, 500, 5000])
    base = np.asarray(jax.vmap(noam_schedule(128, 100))(counts))
    scaled = np.asarray(jax.vmap(noam_schedule(128, 100, factor=2.5))(counts))
    np.testing.assert_allclose(scaled, 2.5 * base, rtol=1e-6)
    np.testing.assert_allclose(scaled, [_paper_lr(int(c) + 1, 128, 100, 2.5) for c in counts], rtol=1e-6)


def test_jit_with_traced_count_and_the_clamp():
    schedule = noam_schedule(d_model=256, warmup_steps=50)
    jitted = jax.jit(schedule)
    for count in (0, 49, 200):
        lr = jitted(jnp.int32(count))
        chex.assert_shape(lr, ())
        assert lr.dtype == jnp.float32
        np.testing.assert_allclose(float(lr), _paper_lr(count + 1, 256, 50), rtol=1e-6)
    # Without the clamp, count -1 is step 0 (0^-0.5 = inf) and count -3 is step -2 (NaN).
    for count in (-1, -3):
        np.testing.assert_allclose(float(jitted(jnp.int32(count))), _paper_lr(1, 256, 50), rtol=1e-6)


def test_drives_adam_with_the_schedule_as_the_learning_rate():
    """The LambdaLR pitfall: the schedule must be the rate itself, not a factor of 0.

    The loss is linear, so every gradient is the same constant g. Adam's bias-corrected
    moments are then exactly g and g^2, and each update is -lr * g / (|g| + eps), i.e.
    -lr * sign(g) to within eps: the updates read out the learning rate used.
    """
    schedule = noam_schedule(d_model=64, warmup_steps=4)
    coefficients = {"w": jnp.array([[1.5, -2.0], [0.25, -0.75], [3.0, 1.0]]), "b": jnp.array([-0.5, 4.0])}
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros((2,))}

    def loss(p):
        return sum(jnp.sum(c * x) for c, x in zip(jax.tree.leaves(coefficients), jax.tree.leaves(p)))

    adam = optax.adam(learning_rate=schedule, b1=0.9, b2=0.98, eps=1e-9)
    # The same optimizer with its learning rate exposed in the state.
    watched = optax.inject_hyperparams(optax.adam)(learning_rate=schedule, b1=0.9, b2=0.98, eps=1e-9)
    state, watched_state = adam.init(params), watched.init(params)
    p = params
    for count in range(8):  # through the peak (count 3) and past it
        grads = jax.grad(loss)(p)
        updates, state = adam.update(grads, state, p)
        watched_updates, watched_state = watched.update(grads, watched_state, p)
        lr = _paper_lr(count + 1, 64, 4)
        np.testing.assert_allclose(float(watched_state.hyperparams["learning_rate"]), lr, rtol=1e-6)
        for u, wu, c in zip(jax.tree.leaves(updates), jax.tree.leaves(watched_updates), jax.tree.leaves(coefficients)):
            np.testing.assert_allclose(u, -lr * np.sign(c), rtol=1e-5)
            np.testing.assert_allclose(wu, u, rtol=1e-6)
        p = optax.apply_updates(p, updates)
    # Each parameter moved by the summed rates, against its gradient.
    total = sum(_paper_lr(step, 64, 4) for step in range(1, 9))
    for moved, start, c in zip(jax.tree.leaves(p), jax.tree.leaves(params), jax.tree.leaves(coefficients)):
        assert np.all(np.abs(np.asarray(moved - start)) > 0.1 * total)
        np.testing.assert_allclose(moved - start, -total * np.sign(c), rtol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=0, warmup_steps=10), "d_model must be a positive int (got 0)"),
    (dict(d_model=-8, warmup_steps=10), "d_model must be a positive int (got -8)"),
    (dict(d_model=64.0, warmup_steps=10), "d_model must be a positive int (got 64.0)"),
    (dict(d_model=True, warmup_steps=10), "d_model must be a positive int (got True)"),
    (dict(d_model=64, warmup_steps=0), "warmup_steps must be a positive int (got 0)"),
    (dict(d_model=64, warmup_steps=2.5), "warmup_steps must be a positive int (got 2.5)"),
    (dict(d_model=64, warmup_steps=10, factor=0.0), "factor must be a finite number > 0 (got 0.0)"),
    (dict(d_model=64, warmup_steps=10, factor=-1.0), "factor must be a finite number > 0 (got -1.0)"),
    (dict(d_model=64, warmup_steps=10, factor=float("nan")), "factor must be a finite number > 0 (got nan)"),
    (dict(d_model=64, warmup_steps=10, factor=float("inf")), "factor must be a finite number > 0 (got inf)"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(f"noam_schedule {message}")):
        noam_schedule(**kwargs)


def test_numpy_arguments_give_the_python_numbers_schedule():
    """np.int64 and 0-d arrays are read as the numbers they hold."""
    plain, from_numpy = noam_schedule(64, 10, 2.0), noam_schedule(np.int64(64), np.asarray(10), np.float32(2.0))
    for step in (0, 9, 100):
        assert float(from_numpy(step)) == float(plain(step))


def _reference_lr_at(step, total, base_lr, warmup=100):
    """The PyTorch reference demo's lr_at, written out."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return 0.1 * base_lr + 0.9 * base_lr * 0.5 * (1 + math.cos(math.pi * p))


def test_warmup_cosine_matches_the_reference_formula():
    from jaxformer import warmup_cosine_schedule
    schedule = warmup_cosine_schedule(3e-3, 100, 800)
    for step in (0, 1, 50, 99, 100, 101, 400, 799, 800):
        np.testing.assert_allclose(float(schedule(step)), _reference_lr_at(step, 800, 3e-3), rtol=1e-5)
    np.testing.assert_allclose(float(schedule(800)), 3e-4, rtol=1e-5)  # the floor: 10 % of the peak
    np.testing.assert_allclose(float(schedule(5000)), 3e-4, rtol=1e-5)  # and it stays there
    np.testing.assert_allclose(float(jax.jit(schedule)(jnp.int32(99))), 3e-3, rtol=1e-6)  # the peak


@pytest.mark.parametrize("args, message", [
    ((0.0, 100, 800), "peak_lr must be a finite number > 0 (got 0.0)"),
    ((float("inf"), 100, 800), "peak_lr must be a finite number > 0 (got inf)"),
    ((3e-3, 0, 800), "warmup_steps must be a positive int (got 0)"),
    ((3e-3, 100, 50), "total_steps must be an int >= warmup_steps=100 (got 50)"),
    ((3e-3, 100, 800.0), "total_steps must be an int >= warmup_steps=100 (got 800.0)"),
    ((3e-3, 100, 800, 1.5), "final_fraction must be a finite number in [0, 1] (got 1.5)"),
    ((3e-3, 100, 800, float("nan")), "final_fraction must be a finite number in [0, 1] (got nan)"),
])
def test_warmup_cosine_bad_arguments(args, message):
    from jaxformer import warmup_cosine_schedule
    with pytest.raises(ValueError, match=re.escape(f"warmup_cosine_schedule {message}")):
        warmup_cosine_schedule(*args)


@pytest.mark.peers
def test_matches_the_reference_torch_lambda_lr_step_by_step():
    """The reference's PyTorch loop: Adam at base lr 1, a LambdaLR of the formula with the
    step clamped to >= 1, and `scheduler.step()` after every `optimizer.step()`.

    LambdaLR calls the lambda with its own counter: 0 for the first update (clamped to
    the paper's step 1), then 1, 2, ... So the reference spends its first two updates at
    step 1, and its update k (0-based) runs at step max(k, 1), which is
    `noam_schedule(k - 1)` (the clamp covers k = 0). jaxformer's update c, at step c + 1,
    is the reference's update c + 1: the same sequence of rates, less the repeated first.

    With a constant gradient Adam's bias-corrected moments are exact, each update is
    `-lr * g / (|g| + eps)`, and the change of a float64 parameter reads out the rate used.
    """
    torch = import_peer("torch")
    d_model, warmup, factor, n_steps = 64, 400, 1.0, 1000
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: factor * d_model ** -0.5 * min(max(step, 1) ** -0.5, max(step, 1) * warmup ** -1.5))
    set_lrs, used_lrs = [], []
    for _ in range(n_steps):
        set_lrs.append(optimizer.param_groups[0]["lr"])
        before = param.detach().clone()
        param.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
        optimizer.step()
        scheduler.step()
        used_lrs.append(float((before - param.detach())[0]) * (1 + 1e-9))  # undo Adam's eps
    np.testing.assert_allclose(used_lrs, set_lrs, rtol=1e-12)

    schedule = noam_schedule(d_model, warmup, factor)
    counts = np.arange(n_steps) - 1  # the reference's update k is jaxformer's count k - 1
    np.testing.assert_allclose(used_lrs, np.asarray(jax.vmap(schedule)(jnp.asarray(counts))), rtol=1e-6)
    assert set_lrs[0] == set_lrs[1]  # the reference's repeated step 1
    assert int(np.argmax(set_lrs)) == warmup  # its peak is one update later than count warmup - 1
