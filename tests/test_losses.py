"""Label-smoothed cross-entropy against a float64 numpy formula, optax and PyTorch."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import import_peer
from jax.experimental import checkify

from jaxformer.losses import label_smoothed_cross_entropy

V = 11


def _numpy_loss_and_grad(logits, targets, smoothing, ignore_id):
    """The loss and its gradient in float64, written out directly:
    loss_i = (1 - e) * -log p_i[t_i] + e * mean_c(-log p_i[c]), averaged over kept i;
    d loss / d logits_i = (p_i - q_i) / n_kept with q_i = (1 - e) * onehot(t_i) + e / V."""
    z = np.asarray(logits, np.float64).reshape(-1, V)
    t = np.asarray(targets).reshape(-1)
    keep = np.ones(t.shape, bool) if ignore_id is None else t != ignore_id
    z, t = z[keep], t[keep]
    log_p = z - z.max(-1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    per_position = (1 - smoothing) * -log_p[np.arange(len(t)), t] + smoothing * -log_p.mean(-1)
    q = (1 - smoothing) * np.eye(V)[t] + smoothing / V
    grad = np.zeros((keep.size, V))
    grad[keep] = (np.exp(log_p) - q) / len(t)
    return per_position.mean(), grad.reshape(np.shape(logits))


def _batch(seed, ignore_id, shape=(3, 7), p_ignore=0.3):
    """Random logits (scale 3, so the softmax is far from uniform) and targets with
    about `p_ignore` of them set to `ignore_id`."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = 3.0 * jax.random.normal(k1, (*shape, V))  # [batch, seq, V]
    targets = jax.random.randint(k2, shape, 0, V)  # [batch, seq]
    if ignore_id is not None:
        targets = jnp.where(jax.random.uniform(k3, shape) < p_ignore, ignore_id, targets)
    return logits, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4, 0.9])
@pytest.mark.parametrize("ignore_id", [None, -100, 0, V])  # 0: a pad id that is also a class
def test_matches_float64_formula_and_its_gradient(smoothing, ignore_id):
    logits, targets = _batch(0, ignore_id)
    if ignore_id is not None:
        n_ignored = int(np.sum(np.asarray(targets) == ignore_id))
        assert 0 < n_ignored < targets.size  # the mask really matters
    want, want_grad = _numpy_loss_and_grad(logits, targets, smoothing, ignore_id)
    loss = label_smoothed_cross_entropy(logits, targets, smoothing, ignore_id)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
    grad = jax.grad(label_smoothed_cross_entropy)(logits, targets, smoothing, ignore_id)
    chex.assert_shape(grad, logits.shape)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
    # The same numbers under jit, with traced targets (no host-side checks there).
    jitted = jax.jit(label_smoothed_cross_entropy, static_argnums=(2, 3))
    np.testing.assert_allclose(float(jitted(logits, targets, smoothing, ignore_id)), want, rtol=1e-5, atol=1e-5)


def test_smoothing_changes_the_loss():
    logits, targets = _batch(1, -100)
    plain = float(label_smoothed_cross_entropy(logits, targets, 0.0, -100))
    smoothed = float(label_smoothed_cross_entropy(logits, targets, 0.1, -100))
    assert abs(smoothed - plain) > 1e-2  # the smoothing term is not silently dropped


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_no_smoothing_equals_optax_over_kept_positions(shape):
    logits, targets = _batch(2, -100, shape=shape)
    keep = np.asarray(targets) != -100
    per_position = optax.softmax_cross_entropy_with_integer_labels(
        logits[keep], targets[keep])  # [n_kept]
    loss = label_smoothed_cross_entropy(logits, targets, 0.0, ignore_id=-100)
    chex.assert_shape(loss, ())
    np.testing.assert_allclose(float(loss), float(per_position.mean()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ignore_id", [-100, 0, V])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_all_ignored_is_zero_with_zero_gradient(ignore_id, smoothing):
    logits = 3.0 * jax.random.normal(jax.random.key(3), (2, 5, V))
    targets = jnp.full((2, 5), ignore_id)
    loss = label_smoothed_cross_entropy(logits, targets, smoothing, ignore_id)
    assert float(loss) == 0.0  # not 0 / 0 = NaN, as PyTorch gives
    grad = jax.grad(label_smoothed_cross_entropy)(logits, targets, smoothing, ignore_id)
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(grad, np.zeros(logits.shape))


def test_garbage_logits_at_ignored_positions_do_not_leak():
    """Padding rows may hold inf or NaN logits; they must reach neither the loss nor
    the gradient (masking only the per-position loss would give a NaN gradient)."""
    logits, targets = _batch(4, -100)
    ignored = np.asarray(targets) == -100
    bad = np.asarray(logits).copy()
    bad[ignored] = np.nan
    bad[ignored, 0] = np.inf
    want, want_grad = _numpy_loss_and_grad(logits, targets, 0.1, -100)
    loss = label_smoothed_cross_entropy(jnp.asarray(bad), targets, 0.1, -100)
    grad = jax.grad(label_smoothed_cross_entropy)(jnp.asarray(bad), targets, 0.1, -100)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


def test_out_of_range_ignored_ids_are_never_gathered():
    """Ignored ids -100 and V, next to ignore_id=None with the same kept positions: the
    out-of-range ids must neither be wrapped (-100 as a negative index) nor clamped (V to
    V - 1) into the loss."""
    logits, targets = _batch(5, None)
    for ignore_id in (-100, V, V + 7):
        padded = targets.at[:, -2:].set(ignore_id)  # [batch, seq], the last two padded
        loss = label_smoothed_cross_entropy(logits, padded, 0.1, ignore_id)
        trimmed = label_smoothed_cross_entropy(logits[:, :-2], targets[:, :-2], 0.1)
        np.testing.assert_allclose(float(loss), float(trimmed), rtol=1e-6, atol=1e-6)
        grad = jax.grad(label_smoothed_cross_entropy)(logits, padded, 0.1, ignore_id)
        np.testing.assert_array_equal(grad[:, -2:], np.zeros((3, 2, V)))
        # JAX's gather never fails on a bad index (it fills or clamps), so ask checkify
        # whether the gather was handed one (the gradient's scatter reuses its indices).
        def loss(x, t, ignore_id=ignore_id):
            return label_smoothed_cross_entropy(x, t, 0.1, ignore_id)
        error, _ = checkify.checkify(loss, errors=checkify.index_checks)(logits, padded)
        assert error.get() is None, error.get()


def test_kept_out_of_range_ids_raise_or_give_nan_under_jit():
    logits, targets = _batch(6, None)
    for bad_id in (-1, V):
        bad = targets.at[0, 0].set(bad_id)
        with pytest.raises(ValueError, match="targets"):
            label_smoothed_cross_entropy(logits, bad, 0.1, ignore_id=-100)
        # Inside jit ids cannot raise; a NaN says so instead of a clamped or wrapped class.
        jitted = jax.jit(label_smoothed_cross_entropy, static_argnums=(2, 3))
        assert np.isnan(float(jitted(logits, bad, 0.1, -100)))


def test_bfloat16_logits_give_a_float32_loss():
    logits, targets = _batch(7, -100)
    bf16 = logits.astype(jnp.bfloat16)
    loss = label_smoothed_cross_entropy(bf16, targets, 0.1, -100)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    # Computed in float32 from the bf16 values: as exact as float32 allows ...
    want, _ = _numpy_loss_and_grad(np.asarray(bf16.astype(jnp.float32)), targets, 0.1, -100)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
    # ... and close to the float32 logits' loss, bf16 rounding of the inputs aside.
    full = float(label_smoothed_cross_entropy(logits, targets, 0.1, -100))
    np.testing.assert_allclose(float(loss), full, rtol=2e-2)


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5, float("nan"), True, "0.1"])
def test_bad_smoothing_raises(smoothing):
    logits, targets = _batch(8, None)
    with pytest.raises(ValueError, match=re.escape(f"label_smoothed_cross_entropy smoothing must be a finite number "
                                                   f"in [0, 1) (got {smoothing!r})")):
        label_smoothed_cross_entropy(logits, targets, smoothing)


def test_bad_shapes_and_dtypes_raise():
    logits, targets = _batch(9, None)  # [3, 7, V], [3, 7]
    with pytest.raises(ValueError, match="shape|logits"):
        label_smoothed_cross_entropy(logits, targets[:, :-1])  # [3, 6]
    with pytest.raises(ValueError, match="shape|logits"):
        label_smoothed_cross_entropy(logits, targets.reshape(-1))  # [21]
    with pytest.raises(ValueError, match="shape|logits"):
        label_smoothed_cross_entropy(logits[..., 0], targets)  # no class axis left to spare
    with pytest.raises(ValueError, match="targets"):
        label_smoothed_cross_entropy(logits, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match=re.escape("label_smoothed_cross_entropy ignore_id must be None or an int "
                                                   "(got 1.5)")):
        label_smoothed_cross_entropy(logits, targets, ignore_id=1.5)


@pytest.mark.peers
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_matches_torch_cross_entropy(smoothing):
    torch = import_peer("torch")
    logits, targets = _batch(10, -100)
    want = torch.nn.functional.cross_entropy(
        torch.tensor(np.asarray(logits)).reshape(-1, V), torch.tensor(np.asarray(targets)).reshape(-1).long(),
        label_smoothing=smoothing, ignore_index=-100)
    loss = label_smoothed_cross_entropy(logits, targets, smoothing, ignore_id=-100)
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5, atol=1e-5)
