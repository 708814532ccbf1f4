"""Label-smoothed cross-entropy against a float64 numpy formula, optax and PyTorch; the chunked
loss from hidden states against the same formula, the whole-logits loss, and its memory."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import torch_peer
from jax.experimental import checkify

from jaxformer.embeddings import OutputHead
from jaxformer.losses import CHUNK_BYTES, chunked_cross_entropy, chunked_token_logps, label_smoothed_cross_entropy

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
    torch = torch_peer()
    logits, targets = _batch(10, -100)
    want = torch.nn.functional.cross_entropy(
        torch.tensor(np.asarray(logits)).reshape(-1, V), torch.tensor(np.asarray(targets)).reshape(-1).long(),
        label_smoothing=smoothing, ignore_index=-100)
    loss = label_smoothed_cross_entropy(logits, targets, smoothing, ignore_id=-100)
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5, atol=1e-5)


# The chunked loss: from hidden states `[..., D]` and an output head, a chunk of positions at a time.

D = 16


def _hidden_batch(seed, ignore_id, tied, softcap=None, shape=(3, 7)):
    """Hidden states, an `OutputHead` and targets: hidden of std 1 and a head of std 0.75
    make logits of std 3 (far from uniform, and past a softcap of 2.0 often enough to matter)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k1, (*shape, D))  # [batch, seq, D]
    weight = 0.75 * jax.random.normal(k2, (V, D) if tied else (D, V))
    _, targets = _batch(seed, ignore_id, shape=shape)
    return hidden, OutputHead(weight, tied, softcap), targets


def _numpy_hidden_loss_and_grads(hidden, head, targets, smoothing, ignore_id):
    """The loss and its gradients w.r.t. the hidden states and the head's weight in float64:
    z = hidden @ W (W^T if tied), logits = cap * tanh(z / cap) (or z), the loss of
    `_numpy_loss_and_grad`, and by the chain rule d z = d logits * (1 - tanh(z / cap)^2),
    d hidden = d z @ W^T (W if tied), d W = hidden^T @ d z (its transpose if tied)."""
    x = np.asarray(hidden, np.float64).reshape(-1, D)  # [n, D]
    w = np.asarray(head.weight, np.float64)
    w_dv = w.T if head.tied else w  # [D, V]
    z = x @ w_dv  # [n, V]
    logits = z if head.softcap is None else head.softcap * np.tanh(z / head.softcap)
    loss, d_logits = _numpy_loss_and_grad(logits, targets, smoothing, ignore_id)
    d_z = d_logits if head.softcap is None else d_logits * (1 - np.tanh(z / head.softcap) ** 2)
    d_w_dv = x.T @ d_z  # [D, V]
    return loss, (d_z @ w_dv.T).reshape(np.shape(hidden)), d_w_dv.T if head.tied else d_w_dv


def _whole(hidden, targets, head, smoothing=0.0, ignore_id=None):
    """The loss the chunked one must equal: the whole logits, then `label_smoothed_cross_entropy`."""
    return label_smoothed_cross_entropy(head.logits(hidden), targets, smoothing, ignore_id)


def _value_and_grads(loss, hidden, head, targets, *args):
    """`loss(hidden, targets, head, *args)` and its gradients w.r.t. `hidden` and `head.weight`,
    jitted: the targets traced (no host-side checks), as a training step runs it."""
    return _jitted_value_and_grads(loss, hidden, head, targets, args)


# One function for the file, its program made once per loss, arguments and head layout (the head's
# static fields): the whole-logits reference of a case is not traced again for each chunk size.
@functools.partial(jax.jit, static_argnums=(0, 4))
def _jitted_value_and_grads(loss, hidden, head, targets, args):
    def f(hidden, weight):
        return loss(hidden, targets, head.replace(weight=weight), *args)
    return jax.value_and_grad(f, argnums=(0, 1))(hidden, head.weight)


@pytest.mark.parametrize("tied, softcap", [(True, None), (False, None), (True, 2.0), (False, 2.0)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_id", [None, -100, 0])
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 21, 50])  # 21 positions: 4 leaves a padded last chunk
def test_chunked_equals_the_whole_logits_loss_and_the_float64_formula(tied, softcap, smoothing, ignore_id,
                                                                      chunk_size):
    """Values and gradients w.r.t. the hidden states and the head: equal, in float32, to the
    whole-logits loss at 2e-6 (the same per-position math; only the sums' order differs), and
    to the float64 formula at 1e-5 (as the logits' loss is held to above)."""
    hidden, head, targets = _hidden_batch(11, ignore_id, tied, softcap)
    if ignore_id is not None:
        assert 0 < int(np.sum(np.asarray(targets) == ignore_id)) < targets.size  # the mask really matters
    (loss, (d_hidden, d_weight)) = _value_and_grads(chunked_cross_entropy, hidden, head, targets, smoothing,
                                                    ignore_id, chunk_size)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    chex.assert_shape([d_hidden, d_weight], [hidden.shape, head.weight.shape])
    (want, (want_hidden, want_weight)) = _value_and_grads(_whole, hidden, head, targets, smoothing, ignore_id)
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_hidden, want_hidden, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_weight, want_weight, rtol=2e-6, atol=2e-6)
    want64, want_hidden64, want_weight64 = _numpy_hidden_loss_and_grads(hidden, head, targets, smoothing, ignore_id)
    np.testing.assert_allclose(float(loss), want64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_hidden, want_hidden64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_weight, want_weight64, rtol=1e-5, atol=1e-5)
    # Eager, with the targets concrete (checked on the host): the same number.
    eager = chunked_cross_entropy(hidden, targets, head, smoothing, ignore_id, chunk_size)
    np.testing.assert_allclose(float(eager), float(want), rtol=2e-6, atol=2e-6)


def test_the_softcap_and_the_head_layout_are_applied():
    """The comparisons above have teeth: a softcap of 2.0 changes the loss, and an untied head
    is read as `[D, V]` (its transpose, read as tied, gives another loss)."""
    hidden, head, targets = _hidden_batch(12, -100, tied=False)
    plain = float(chunked_cross_entropy(hidden, targets, head, 0.1, -100, 4))
    capped = float(chunked_cross_entropy(hidden, targets, head.replace(softcap=2.0), 0.1, -100, 4))
    assert abs(capped - plain) > 0.1
    weight = 0.75 * jax.random.normal(jax.random.key(0), (D, D))  # both layouts fit: V = D here
    square, swapped = OutputHead(weight, tied=False), OutputHead(weight, tied=True)
    assert abs(float(chunked_cross_entropy(hidden, targets, square, 0.0, -100))
               - float(chunked_cross_entropy(hidden, targets, swapped, 0.0, -100))) > 0.1


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_ignores_garbage_and_gives_zero_when_nothing_is_kept(smoothing):
    """NaN and inf hidden states at ignored positions reach neither the loss nor either gradient
    (not even the head's, hidden^T @ d_logits); every target ignored gives 0.0, gradients 0."""
    hidden, head, targets = _hidden_batch(13, -100, tied=False)
    ignored = np.asarray(targets) == -100
    bad = np.asarray(hidden).copy()
    bad[ignored] = np.nan
    bad[ignored, 0] = np.inf
    loss, (d_hidden, d_weight) = _value_and_grads(chunked_cross_entropy, jnp.asarray(bad), head, targets, smoothing,
                                                  -100, 4)
    want, (want_hidden, want_weight) = _value_and_grads(_whole, hidden, head, targets, smoothing, -100)
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_hidden, want_hidden, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_weight, want_weight, rtol=2e-6, atol=2e-6)
    nothing = jnp.full(targets.shape, -100)
    loss, (d_hidden, d_weight) = _value_and_grads(chunked_cross_entropy, hidden, head, nothing, smoothing, -100, 4)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(d_hidden, np.zeros(hidden.shape))
    np.testing.assert_array_equal(d_weight, np.zeros(head.weight.shape))



def _whole_token_logps(hidden, targets, head, ignore_id):
    """What `chunked_token_logps` must equal: `log_softmax` of the whole logits read at each
    target, 0.0 where the target is `ignore_id`."""
    keep = targets != ignore_id
    log_p = jax.nn.log_softmax(head.logits(hidden), axis=-1)  # [..., V]
    return jnp.where(keep, jnp.take_along_axis(log_p, jnp.where(keep, targets, 0)[..., None], axis=-1)[..., 0], 0.0)


def _weighted(token_logps):
    """`sum_i c_i log p_i` of `token_logps(hidden, targets, head, *args)`, with fixed random weights
    `c` (a cotangent that tells the positions apart, as a sequence's sum would not)."""
    def loss(hidden, targets, head, *args):
        c = jax.random.normal(jax.random.key(7), targets.shape)
        return jnp.sum(c * token_logps(hidden, targets, head, *args))
    return loss


_CHUNKED_SUM, _WHOLE_SUM = _weighted(chunked_token_logps), _weighted(_whole_token_logps)


@pytest.mark.parametrize("chunk_size, tied", [(None, True), (1, False), (4, True), (21, False), (50, True)])
def test_token_logps_are_the_whole_logits_log_softmax_at_the_targets_and_their_gradients(chunk_size, tied):
    """Each position's `log p[target]` and the gradients w.r.t. the hidden states and the head, in
    chunks of `chunk_size` positions (21 positions: 4 leaves a padded last chunk), equal the whole
    logits' at 2e-6 (the same per-position math, as the chunked loss above: only the sums' order
    differs); an ignored position is exactly 0.0 with an exactly zero gradient, whatever its hidden
    state holds (NaN and inf here)."""
    hidden, head, targets = _hidden_batch(16, -100, tied)
    ignored = np.asarray(targets) == -100
    assert 0 < ignored.sum() < ignored.size  # the mask really matters
    bad = np.asarray(hidden).copy()
    bad[ignored] = np.nan
    bad[ignored, 0] = np.inf
    got = chunked_token_logps(jnp.asarray(bad), targets, head, ignore_id=-100, chunk_size=chunk_size)
    chex.assert_shape(got, targets.shape)
    chex.assert_type(got, jnp.float32)
    want = _whole_token_logps(hidden, targets, head, -100)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[ignored], 0.0)
    assert np.all(np.asarray(got)[~ignored] < 0)
    total, (d_hidden, d_weight) = _value_and_grads(_CHUNKED_SUM, jnp.asarray(bad), head, targets, -100, chunk_size)
    want_total, (want_hidden, want_weight) = _value_and_grads(_WHOLE_SUM, hidden, head, targets, -100)
    np.testing.assert_allclose(float(total), float(want_total), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_hidden, want_hidden, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d_weight, want_weight, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(d_hidden)[ignored], 0.0)

def test_chunked_kept_out_of_range_ids_raise_or_give_nan_under_jit():
    hidden, head, targets = _hidden_batch(14, None, tied=True)
    for bad_id in (-1, V):
        bad = targets.at[0, 0].set(bad_id)
        with pytest.raises(ValueError, match=re.escape("chunked_cross_entropy: targets hold ids outside [0, V=11)")):
            chunked_cross_entropy(hidden, bad, head, 0.1, ignore_id=-100)
        loss, _ = _value_and_grads(chunked_cross_entropy, hidden, head, bad, 0.1, -100, 4)
        assert np.isnan(float(loss))


def test_chunked_bad_arguments_raise_naming_them():
    hidden, head, targets = _hidden_batch(15, None, tied=True)  # [3, 7, D], [V, D], [3, 7]
    shapes = re.escape("chunked_cross_entropy: hidden must be [..., d_model], targets the same shape")
    with pytest.raises(ValueError, match=shapes):
        chunked_cross_entropy(hidden, targets[:, :-1], head)
    with pytest.raises(ValueError, match=shapes):
        chunked_cross_entropy(hidden[..., :-1], targets, head)  # d_model 15, the head's 16
    with pytest.raises(ValueError, match=shapes):
        chunked_cross_entropy(hidden, targets, head.replace(tied=False))  # [V, D] read as [D, V]
    with pytest.raises(ValueError, match=re.escape("chunked_cross_entropy: head must be an OutputHead")):
        chunked_cross_entropy(hidden, targets, head.weight)
    with pytest.raises(ValueError, match="chunked_cross_entropy: targets must hold integer ids"):
        chunked_cross_entropy(hidden, targets.astype(jnp.float32), head)
    with pytest.raises(ValueError, match=re.escape("chunked_cross_entropy chunk_size must be")):
        chunked_cross_entropy(hidden, targets, head, chunk_size=0)
    with pytest.raises(ValueError, match=re.escape("chunked_cross_entropy smoothing must be a finite number")):
        chunked_cross_entropy(hidden, targets, head, smoothing=1.0)
    with pytest.raises(ValueError, match=re.escape("chunked_cross_entropy ignore_id must be None or an int")):
        chunked_cross_entropy(hidden, targets, head, ignore_id=1.5)


def test_chunked_loss_never_holds_the_whole_logits():
    """XLA's scratch memory for the loss and its gradients at a Llama-3 vocabulary (128,256),
    T 2048, batch 1 (d_model 64 keeps the head small): the whole-logits loss holds several
    [T, V] float32 arrays; the chunked one a few chunks' logits (CHUNK_BYTES each) and the
    head's gradient, under a quarter of one [T, V] float32 array."""
    vocab, T, d = 128_256, 2048, 64
    hidden = jax.ShapeDtypeStruct((1, T, d), jnp.float32)
    weight = jax.ShapeDtypeStruct((vocab, d), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, T), jnp.int32)

    def temp_bytes(loss):
        def f(hidden, weight, targets):
            return loss(hidden, targets, OutputHead(weight, tied=True), 0.1, -100)
        analysis = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(hidden, weight, targets).compile()
        analysis = analysis.memory_analysis()
        if analysis is None:
            pytest.skip(f"no memory analysis on {jax.default_backend()}")
        return analysis.temp_size_in_bytes

    logits_bytes = T * vocab * 4
    chunked, whole = temp_bytes(chunked_cross_entropy), temp_bytes(_whole)
    print(f"\nvalue_and_grad temp bytes at V={vocab}, T={T}, d={d}: chunked {chunked / 2**20:.1f} MiB, "
          f"whole logits {whole / 2**20:.1f} MiB; one [T, V] float32 array {logits_bytes / 2**20:.1f} MiB, "
          f"a chunk's logits at most {CHUNK_BYTES / 2**20:.0f} MiB")
    assert whole >= logits_bytes  # the measure sees the logits
    assert chunked < logits_bytes / 4
