"""GRPO's group advantages and clipped objective against the formulas written out in float64
numpy (loops over completions and tokens), their gradient, and the arguments they refuse."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.grpo import STD_EPS, group_advantages, grpo_loss

EPS = 0.2


def _numpy_grpo(logps, old, ref, adv, mask, epsilon, beta):
    """The loss, its metrics and d loss / d logps in float64, token by token:
    rho = exp(logp - old); term = -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta KL with
    KL = exp(ref - logp) - (ref - logp) - 1; loss = 1/B sum_i (1/max(n_i, 1)) sum_{masked t} term.
    The gradient of a token: -A rho where the unclipped branch is the min (0 where the clip holds)
    plus beta (1 - exp(ref - logp)), over B max(n_i, 1)."""
    logps, old, adv, mask = (np.asarray(x, np.float64) for x in (logps, old, adv, mask))
    ref = None if ref is None else np.asarray(ref, np.float64)
    b, t = logps.shape
    loss, grad = 0.0, np.zeros((b, t))
    kl_sum = clipped_sum = count = 0.0
    for i in range(b):
        n_i = max(mask[i].sum(), 1)
        for j in range(t):
            if not mask[i, j]:
                continue
            rho = np.exp(logps[i, j] - old[i, j])
            a = adv[i]
            clipped = (rho < 1 - epsilon and a < 0) or (rho > 1 + epsilon and a > 0)
            term = -min(rho * a, min(max(rho, 1 - epsilon), 1 + epsilon) * a)
            d_term = 0.0 if clipped else -a * rho
            kl = 0.0
            if ref is not None:
                x = ref[i, j] - logps[i, j]
                kl = np.exp(x) - x - 1
                term += beta * kl
                d_term += beta * (1 - np.exp(x))
            loss += term / n_i / b
            grad[i, j] = d_term / n_i / b
            kl_sum += kl
            clipped_sum += clipped
            count += 1
    count = max(count, 1)
    return loss, {"kl": kl_sum / count, "clip_ratio": clipped_sum / count}, grad


def _batch(key, b=6, t=9, spread=1.0):
    """Random log-probabilities whose ratios to the old ones reach exp(±3 spread) (far outside
    1 ± 0.2), advantages of both signs, and completions of lengths 9, 0 (an empty row), then
    random ones."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    old = -jnp.abs(jax.random.normal(k1, (b, t))) - 0.1  # [B, T] log pi_old < 0
    logps = old + spread * jax.random.uniform(k2, (b, t), minval=-3, maxval=3)  # [B, T]
    ref = old + 0.5 * jax.random.normal(k3, (b, t))  # [B, T]
    adv = jax.random.normal(k4, (b,))  # [B]
    lengths = jnp.concatenate([jnp.array([t, 0]), jax.random.randint(k5, (b - 2,), 1, t)])  # [B]
    mask = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T] completion tokens first, then padding
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("beta, with_ref", [(0.0, False), (0.0, True), (0.04, True), (0.5, True)])
def test_loss_metrics_and_gradient_match_the_float64_formula(beta, with_ref):
    logps, old, ref, adv, mask = _batch(jax.random.key(0))
    ref = ref if with_ref else None
    want_loss, want_metrics, want_grad = _numpy_grpo(logps, old, ref, adv, mask, EPS, beta)
    # The inputs really reach each case: both signs of A, ratios clipped above and below, an empty row.
    assert (np.asarray(adv) > 0).any() and (np.asarray(adv) < 0).any()
    ratio = np.exp(np.asarray(logps - old))[np.asarray(mask)]
    assert (ratio > 1 + EPS).any() and (ratio < 1 - EPS).any()
    assert not np.asarray(mask)[1].any() and 0 < want_metrics["clip_ratio"] < 1

    loss_fn = functools.partial(grpo_loss, epsilon=EPS, beta=beta)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logps, old, ref, adv, mask)
    chex.assert_shape([loss, metrics["kl"], metrics["clip_ratio"]], ())
    chex.assert_type([loss, metrics["kl"], metrics["clip_ratio"]], jnp.float32)
    chex.assert_shape(grad, logps.shape)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    for name in ("kl", "clip_ratio"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, atol=1e-7)
    if not with_ref:
        assert float(metrics["kl"]) == 0.0
    else:
        assert want_metrics["kl"] > 0.01
    # jit gives the same figures.
    jit_loss, jit_metrics = jax.jit(loss_fn)(logps, old, ref, adv, mask)
    np.testing.assert_allclose(jit_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(jit_metrics["clip_ratio"], metrics["clip_ratio"], rtol=1e-6)


def test_the_gradient_matches_finite_differences_of_the_numpy_loss():
    """The float64 loss's central differences, at a point away from the clip's edges (ratios in
    exp(±0.9), across 1 ± 0.2 but not within 1e-3 of it)."""
    logps, old, ref, adv, mask = _batch(jax.random.key(1), b=4, t=5, spread=0.3)
    rho = np.exp(np.asarray(logps - old, np.float64))
    assert np.abs(rho - (1 + EPS)).min() > 1e-3 and np.abs(rho - (1 - EPS)).min() > 1e-3
    _, grad = jax.value_and_grad(functools.partial(grpo_loss, epsilon=EPS, beta=0.1), has_aux=True)(
        logps, old, ref, adv, mask)
    x = np.asarray(logps, np.float64)
    h = 1e-6
    want = np.zeros_like(x)
    for i, j in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i, j] += h
        down[i, j] -= h
        want[i, j] = (_numpy_grpo(up, old, ref, adv, mask, EPS, 0.1)[0]
                      - _numpy_grpo(down, old, ref, adv, mask, EPS, 0.1)[0]) / (2 * h)
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_old_and_ref_log_probabilities_are_constants():
    logps, old, ref, adv, mask = _batch(jax.random.key(2))
    loss_fn = functools.partial(grpo_loss, epsilon=EPS, beta=0.1)
    d_old, d_ref = jax.grad(lambda o, r: loss_fn(logps, o, r, adv, mask)[0], argnums=(0, 1))(old, ref)
    assert float(jnp.abs(d_old).max()) == 0.0 and float(jnp.abs(d_ref).max()) == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_at_the_sampling_policy_the_ratio_is_one(beta):
    """old == logps: rho = 1 everywhere, the clip never holds, each token's term is -A_i
    (+ beta KL), so the loss is -mean(A) + beta * mean_i(masked mean of KL), and the gradient
    -A_i / (B n_i) + beta (1 - exp(ref - logp)) / (B n_i)."""
    logps, _, ref, adv, mask = _batch(jax.random.key(3))
    mask = mask.at[1].set(True)  # every completion has tokens: -mean(A) is over all B
    (loss, metrics), grad = jax.value_and_grad(functools.partial(grpo_loss, epsilon=EPS, beta=beta), has_aux=True)(
        logps, logps, ref, adv, mask)
    m, n = np.asarray(mask), np.asarray(mask).sum(1, keepdims=True)
    x = np.asarray(ref - logps, np.float64)
    kl = np.exp(x) - x - 1
    want = -np.mean(np.asarray(adv)) + beta * np.mean((kl * m).sum(1) / n[:, 0])
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert float(metrics["clip_ratio"]) == 0.0
    want_grad = (-np.asarray(adv)[:, None] + beta * (1 - np.exp(x))) * m / (len(m) * n)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_padding_holding_nan_or_inf_changes_nothing():
    logps, old, ref, adv, mask = _batch(jax.random.key(4))
    loss_fn = jax.value_and_grad(functools.partial(grpo_loss, epsilon=EPS, beta=0.1), has_aux=True)
    (loss, metrics), grad = loss_fn(logps, old, ref, adv, mask)
    poison = [jnp.where(mask, x, fill) for x, fill in ((logps, jnp.nan), (old, -jnp.inf), (ref, jnp.inf))]
    (loss2, metrics2), grad2 = loss_fn(*poison, adv, mask)
    assert float(loss2) == float(loss) and float(metrics2["kl"]) == float(metrics["kl"])
    np.testing.assert_array_equal(grad2, grad)
    assert float(jnp.abs(jnp.where(mask, 0.0, grad2)).max()) == 0.0


def test_bfloat16_inputs_give_the_float32_figures_of_their_values():
    logps, old, ref, adv, mask = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x
                                  for x in _batch(jax.random.key(5)))
    loss, metrics = grpo_loss(logps, old, ref, adv, mask, epsilon=EPS, beta=0.1)
    assert loss.dtype == jnp.float32 and metrics["kl"].dtype == jnp.float32
    want, _ = grpo_loss(*(x.astype(jnp.float32) for x in (logps, old, ref, adv)), mask, epsilon=EPS, beta=0.1)
    assert float(loss) == float(want)


def test_no_completion_token_gives_zeros():
    logps, old, ref, adv, mask = _batch(jax.random.key(6))
    loss, metrics = grpo_loss(logps, old, ref, adv, jnp.zeros_like(mask), epsilon=EPS, beta=0.1)
    assert (float(loss), float(metrics["kl"]), float(metrics["clip_ratio"])) == (0.0, 0.0, 0.0)


def test_group_advantages_match_numpy_unbiased_std():
    rewards = jax.random.uniform(jax.random.key(7), (4 * 5,))  # 4 prompts, 5 completions each
    adv = group_advantages(rewards, 5)
    chex.assert_shape(adv, (20,))
    chex.assert_type(adv, jnp.float32)
    r = np.asarray(rewards, np.float64).reshape(4, 5)
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + STD_EPS)
    np.testing.assert_allclose(adv, want.reshape(20), rtol=1e-5, atol=1e-6)
    # Each group's advantages sum to 0 and have unbiased std std / (std + 1e-4), just under 1.
    groups = np.asarray(adv, np.float64).reshape(4, 5)
    np.testing.assert_allclose(groups.sum(1), 0, atol=1e-5)
    np.testing.assert_allclose(groups.std(1, ddof=1), r.std(1, ddof=1) / (r.std(1, ddof=1) + STD_EPS), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(group_advantages, static_argnums=1)(rewards, 5), adv, rtol=1e-6)


def test_a_group_of_equal_rewards_gets_exactly_zero():
    """0.7 sixteen times: a float32 mean of them is not 0.7 exactly, and a plain r - mean would
    give advantages of about 1e-3 once divided by 1e-4."""
    rewards = jnp.concatenate([jnp.full((16,), 0.7), jnp.arange(16.0) % 2, jnp.zeros(16)])  # [48]
    adv = np.asarray(group_advantages(rewards, 16))
    assert (adv[:16] == 0).all() and (adv[32:] == 0).all()
    np.testing.assert_allclose(np.abs(adv[16:32]), 0.5 / (np.std(np.arange(16) % 2, ddof=1) + STD_EPS), rtol=1e-6)
    np.testing.assert_array_equal(group_advantages(jnp.array([1, 0, 1, 1]), 2)[2:], [0.0, 0.0])  # int rewards


@pytest.mark.parametrize("group_size, n, message", [
    (1, 4, "group_advantages group_size must be an int >= 2 (got 1)"),
    (2.0, 4, "group_advantages group_size must be an int >= 2 (got 2.0)"),
    (3, 4, "group_advantages group_size must divide the number of rewards n=4"),
])
def test_group_advantages_refuse_bad_group_sizes(group_size, n, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        group_advantages(jnp.zeros(n), group_size)


def test_group_advantages_refuse_rewards_not_1d_numbers():
    with pytest.raises(ValueError, match=r"rewards must be a 1-D array of numbers \[n\], got shape \(2, 2\)"):
        group_advantages(jnp.zeros((2, 2)), 2)
    with pytest.raises(ValueError, match="got shape .4,., dtype bool"):
        group_advantages(jnp.zeros(4, bool), 2)


def test_bad_arguments_are_refused():
    logps, old, ref, adv, mask = _batch(jax.random.key(8), b=3, t=4)
    good = dict(logps=logps, old_logps=old, ref_logps=ref, advantages=adv, mask=mask, epsilon=EPS, beta=0.1)
    cases = [
        (dict(epsilon=0.0), r"grpo_loss epsilon must be a finite number > 0 \(got 0.0\)"),
        (dict(epsilon=float("nan")), r"grpo_loss epsilon must be a finite number > 0"),
        (dict(beta=-0.1), r"grpo_loss beta must be a finite number >= 0 \(got -0.1\)"),
        (dict(ref_logps=None), r"grpo_loss ref_logps must be given when beta > 0: .* \(got None with beta=0.1\)"),
        (dict(logps=logps[0]), r"grpo_loss logps must be 2-D \[B, T\] with B >= 1, got shape \(4,\)"),
        (dict(logps=logps[:0]), r"grpo_loss logps must be 2-D \[B, T\] with B >= 1, got shape \(0, 4\)"),
        (dict(old_logps=old[:, :3]), r"grpo_loss old_logps must be float \[B, T\] = \[3, 4\] like logps, "
                                     r"got shape \(3, 3\)"),
        (dict(ref_logps=ref.astype(jnp.int32)), r"grpo_loss ref_logps must be float .* dtype int32"),
        (dict(logps=logps.astype(jnp.int32)), r"grpo_loss logps must be float .* dtype int32"),
        (dict(advantages=adv[:, None]), r"grpo_loss advantages must be float \[B\] = \[3\], one per completion, "
                                        r"got shape \(3, 1\)"),
        (dict(mask=mask.astype(jnp.int32)), r"grpo_loss mask must be bool \[B, T\] = \[3, 4\], .* dtype int32"),
        (dict(mask=mask[:2]), r"grpo_loss mask must be bool .* got shape \(2, 4\)"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            grpo_loss(**{**good, **change})
    # Shapes are static, so jit checks them too.
    with pytest.raises(ValueError, match=r"grpo_loss mask must be bool"):
        jax.jit(functools.partial(grpo_loss, epsilon=EPS, beta=0.1))(logps, old, ref, adv, mask[:2])
