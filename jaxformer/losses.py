"""Cross-entropy with label smoothing and ignored (padding) targets.

With `e` the smoothing and `V` the number of classes, the target distribution puts
`1 - e` on the true class and spreads `e` uniformly over all `V` classes (the true one
included), so the loss at one position is

    loss = (1 - e) * -log p[target] + e * mean_c(-log p[c])

and the result is its mean over the positions whose target is not `ignore_id`. This is
PyTorch's `F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
label_smoothing=e, ignore_index=ignore_id)` with the default mean reduction, except
that a batch with every target ignored gives 0.0 (PyTorch gives 0 / 0 = NaN).

The 2017 paper trains with e = 0.1: it hurts perplexity, as the model learns to be
less sure, but improves accuracy and BLEU.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.validation import as_float, as_int, is_traced


def label_smoothed_cross_entropy(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0,
                                 ignore_id: int | None = None) -> jax.Array:
    """Mean label-smoothed cross-entropy over the targets that are not ignored.

    Ignored positions (padding) contribute nothing, whatever their target id (it may lie
    outside `[0, V)`, like PyTorch's -100) and whatever their logits hold: they are
    replaced before the softmax, so even inf or NaN logits there leave the loss and its
    gradient finite.

    Args:
      logits: `[..., V]` unnormalised scores, any float dtype; the log-softmax runs in
        float32.
      targets: integer `[...]` (the shape of `logits` without its last axis), ids in
        `[0, V)` or equal to `ignore_id`.
      smoothing: `e`, a number in `[0, 1)`; 0 is the plain cross-entropy.
      ignore_id: the target id of positions to skip (an int), or None to keep every position.

    Returns:
      A float32 scalar: the mean loss over kept positions; exactly 0.0 (with a zero
      gradient) when none is kept. Inside `jit`, where ids cannot raise, a kept target
      outside `[0, V)` makes it NaN instead of reading a clamped or wrapped class.

    Raises:
      ValueError: `smoothing` outside `[0, 1)`, `ignore_id` not an int, mismatched
        shapes, non-integer targets, or (for concrete targets) a kept target outside
        `[0, V)`.
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
