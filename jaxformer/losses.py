"""Cross-entropy with label smoothing and ignored (padding) targets, as PyTorch's
`F.cross_entropy(label_smoothing=, ignore_index=)` (the formula: docs/training.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.validation import as_float, as_int, is_traced


def label_smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0,
                                 ignore_id: int | None = None) -> jax.Array:
    """Mean of `(1 - e) * -log p[target] + e * mean_c(-log p[c])` over the targets not ignored.

    Ignored positions count for nothing whatever their id (PyTorch's -100) or logits: their
    logits are zeroed before the softmax, so even inf or NaN there leaves the loss and its
    gradient finite.

    Args:
      logits: `[..., V]` scores, any float dtype; the log-softmax runs in float32.
      targets: integer `[...]`, ids in `[0, V)` or equal to `ignore_id`.
      smoothing: `e`, a number in `[0, 1)`; 0 is the plain cross-entropy.
      ignore_id: the target id of positions to skip, or None to keep every position.

    Returns:
      A float32 scalar; exactly 0.0, with a zero gradient, when nothing is kept (PyTorch:
      NaN). Inside `jit` a kept id outside `[0, V)` makes it NaN rather than read a wrong class.

    Raises:
      ValueError: `smoothing` outside `[0, 1)`, `ignore_id` not an int, mismatched shapes,
        non-integer targets, or a concrete kept target outside `[0, V)`.
    """
    smoothing = as_float(smoothing, "label_smoothed_cross_entropy smoothing", at_least=0, below=1)
    ignore_id = as_int(ignore_id, "label_smoothed_cross_entropy ignore_id", optional=True)
    logits = jnp.asarray(logits)
    targets = jnp.asarray(targets)
    if logits.ndim < 1 or logits.shape[-1] < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"label_smoothed_cross_entropy: logits must be [..., V] with V >= 1 and targets "
            f"the same shape without V; got logits {logits.shape}, targets {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"label_smoothed_cross_entropy: targets must hold integer ids, got dtype {targets.dtype}")
    vocab = logits.shape[-1]
    if not is_traced(targets):
        _check_kept_targets(np.asarray(targets), vocab, ignore_id)

    keep = jnp.ones(targets.shape, bool) if ignore_id is None else targets != ignore_id  # [...]
    in_vocab = (targets >= 0) & (targets < vocab)  # [...]
    # Gather only in-range ids: an ignored -100 or V would otherwise be wrapped or clamped.
    safe_targets = jnp.where(keep & in_vocab, targets, 0)  # [...]
    # Ignored rows become zeros before the softmax: whatever they held (inf, NaN) can
    # then produce neither a NaN value nor a NaN gradient (0 * NaN is NaN, so masking
    # the loss afterwards would not be enough for the gradient).
    logits32 = jnp.where(keep[..., None], logits.astype(jnp.float32), 0.0)  # [..., V] float32
    log_probs = jax.nn.log_softmax(logits32, axis=-1)  # [..., V]
    nll = -jnp.take_along_axis(log_probs, safe_targets[..., None], axis=-1)[..., 0]  # [...] -log p[target]
    if smoothing > 0:
        # e * mean_c(-log p[c]): the uniform part of the target. Skipped at e == 0 so a
        # -inf logit (a class masked out) does not turn 0 * inf into NaN.
        per_position = (1.0 - smoothing) * nll + smoothing * -jnp.mean(log_probs, axis=-1)  # [...]
    else:
        per_position = nll
    per_position = jnp.where(in_vocab, per_position, jnp.nan)  # a kept bad id poisons the mean
    per_position = jnp.where(keep, per_position, 0.0)  # [...]
    # max(n, 1): with nothing kept the sum is 0 and so is the mean, not 0 / 0.
    n_kept = jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)  # []
    return jnp.sum(per_position) / n_kept


def _check_kept_targets(targets: np.ndarray, vocab: int, ignore_id: int | None) -> None:
    """Raises if a target that is not `ignore_id` lies outside `[0, vocab)`."""
    kept = targets if ignore_id is None else targets[targets != ignore_id]
    bad = kept[(kept < 0) | (kept >= vocab)]
    if bad.size:
        raise ValueError(
            f"label_smoothed_cross_entropy: targets hold ids outside [0, V={vocab}) that are "
            f"not ignore_id={ignore_id!r}: e.g. {int(bad[0])}")
