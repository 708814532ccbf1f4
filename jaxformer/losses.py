"""Cross-entropy with label smoothing and ignored (padding) targets, as PyTorch's
`F.cross_entropy(label_smoothing=, ignore_index=)` (the formula: docs/training.md): from the
logits (`label_smoothed_cross_entropy`), or from the final hidden states and the output head
a chunk of positions at a time, never holding the whole logits (`chunked_cross_entropy`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.embeddings import OutputHead
from jaxformer.validation import as_float, as_int, is_traced

# `chunked_cross_entropy`'s default chunk: as many positions as make this many bytes of float32
# logits (at least one position): 130 positions of a 128,256-token vocabulary, a small vocabulary's
# whole batch at once.
CHUNK_BYTES = 64 * 2**20


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
    _check_targets("label_smoothed_cross_entropy", targets, logits.shape[-1], ignore_id)
    keep = _kept(targets, ignore_id)  # [...]
    return jnp.sum(_per_position(logits, targets, keep, smoothing)) / _count(keep)


def chunked_cross_entropy(hidden: jax.Array, targets: jax.Array, head: OutputHead, smoothing: float = 0.0,
                          ignore_id: int | None = None, chunk_size: int | None = None) -> jax.Array:
    """`label_smoothed_cross_entropy(head.logits(hidden), targets, smoothing, ignore_id)`, the
    same number and gradients, without ever holding more than one chunk's logits.

    The positions (every row's, one after another) are cut into chunks of `chunk_size`, and a
    `jax.lax.scan` makes each chunk's logits `[chunk_size, V]`, scores them and drops them. The
    chunks are of positions, not of the vocabulary: a position's log-softmax then sees its whole
    row of logits at once, the very formula `label_smoothed_cross_entropy` runs (a vocabulary
    chunk would need a running log-sum-exp carried across chunks, and a second pass for the
    smoothing's mean). The chunk's body is `jax.checkpoint`ed: the backward pass recomputes a
    chunk's logits from its hidden states rather than keep every chunk's, so forward and
    backward hold a few float32 arrays of one chunk's logits (the logits, their log-softmax, their
    gradient) and the head's gradient, whatever the sequence length.

    Args:
      hidden: `[..., d_model]`, the final normalised stream (`Decoder.apply(..., hidden=True)`),
        any float dtype; the logits are made in it, the log-softmax runs in float32.
      targets: integer `[...]`, ids in `[0, V)` or equal to `ignore_id`.
      head: the `OutputHead` (`Decoder.output_head(params)`): the logits are `head.logits(hidden)`.
      smoothing: `e`, a number in `[0, 1)`, as `label_smoothed_cross_entropy`'s.
      ignore_id: the target id of positions to skip, or None to keep every position.
      chunk_size: positions per chunk, or None for as many as make `CHUNK_BYTES` of float32
        logits. It need not divide the number of positions: the last chunk is padded with
        ignored positions.

    Returns:
      A float32 scalar, as `label_smoothed_cross_entropy`'s.

    Raises:
      ValueError: `label_smoothed_cross_entropy`'s, a `head` that is not an `OutputHead` or not
        of `hidden`'s `d_model`, or a `chunk_size` below 1.
    """
    smoothing = as_float(smoothing, "chunked_cross_entropy smoothing", at_least=0, below=1)
    ignore_id = as_int(ignore_id, "chunked_cross_entropy ignore_id", optional=True)
    x, t, k, keep = _chunks("chunked_cross_entropy", hidden, targets, head, ignore_id, chunk_size)

    # Saved for the backward pass: only the chunk's inputs; its logits are made again there.
    @jax.checkpoint
    def chunk_sum(head, x, t, k):
        logits = head.logits(x)  # [chunk, V], the only logits alive
        return jnp.sum(_per_position(logits, t, k, smoothing))  # [] this chunk's summed loss

    def step(total, chunk):
        return total + chunk_sum(head, *chunk), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (x, t, k))  # sum over every kept position
    return total / _count(keep)


def chunked_token_logps(hidden: jax.Array, targets: jax.Array, head: OutputHead, ignore_id: int | None = None,
                        chunk_size: int | None = None) -> jax.Array:
    """`log p[target]` at each position, `log_softmax(head.logits(hidden))` read at its target,
    a chunk of positions at a time as `chunked_cross_entropy` makes them (its arguments, without
    smoothing): what a sequence's log-probability sums (preference and reinforcement losses,
    `jaxformer.preference`), with gradients, never holding more than one chunk's logits.

    Returns:
      float32 `[...]`, targets' shape: `log p[target]` (<= 0) where kept, exactly 0.0 with a zero
      gradient at an ignored position; NaN at a kept id outside `[0, V)` inside `jit`.

    Raises:
      ValueError: as `chunked_cross_entropy`'s.
    """
    ignore_id = as_int(ignore_id, "chunked_token_logps ignore_id", optional=True)
    x, t, k, _ = _chunks("chunked_token_logps", hidden, targets, head, ignore_id, chunk_size)

    @jax.checkpoint  # (as chunked_cross_entropy's: the backward pass makes the chunk's logits again)
    def chunk_logps(head, x, t, k):
        return -_per_position(head.logits(x), t, k, 0.0)  # [chunk]: log p[target], 0 where not kept

    _, logps = jax.lax.scan(lambda carry, chunk: (carry, chunk_logps(head, *chunk)), None, (x, t, k))
    return logps.reshape(-1)[:targets.size].reshape(targets.shape)  # [n_chunks, chunk] -> [...], padding dropped


def _chunks(name: str, hidden, targets, head: OutputHead, ignore_id: int | None, chunk_size: int | None):
    """The positions of `hidden` `[..., d_model]` and `targets` `[...]`, checked, cut into chunks of
    `chunk_size` (default `chunk_positions`), the last padded with positions not kept:
    `x [n_chunks, chunk, d_model]` (zero where not kept), `t`, `k [n_chunks, chunk]`, and `keep [...]`."""
    chunk_size = as_int(chunk_size, f"{name} chunk_size", minimum=1, optional=True)
    if not isinstance(head, OutputHead):
        raise ValueError(f"{name}: head must be an OutputHead (Decoder.output_head(params)), "
                         f"got {type(head).__name__}")
    hidden = jnp.asarray(hidden)
    targets = jnp.asarray(targets)
    if (hidden.ndim < 1 or hidden.shape[:-1] != targets.shape or head.weight.ndim != 2
            or hidden.shape[-1] != head.d_model or head.vocab_size < 1):
        raise ValueError(
            f"{name}: hidden must be [..., d_model], targets the same shape without d_model, "
            f"and head.weight [V, d_model] if tied, else [d_model, V], with V >= 1; got hidden {hidden.shape}, "
            f"targets {targets.shape}, head.weight {head.weight.shape} (tied={head.tied})")
    _check_targets(name, targets, head.vocab_size, ignore_id)
    keep = _kept(targets, ignore_id)  # [...]

    n = targets.size
    if chunk_size is None:
        chunk_size = chunk_positions(head.vocab_size)
    chunk_size = min(chunk_size, max(n, 1))  # no chunk longer than the positions there are
    n_chunks = -(-n // chunk_size)  # ceil(n / chunk_size)
    pad = n_chunks * chunk_size - n  # the last chunk's padding: ignored positions (keep False)
    # An ignored position's hidden state is zeroed: whatever it holds (a NaN) would otherwise
    # reach the head's gradient, hidden^T @ d_logits, as NaN * 0 = NaN. Its loss and gradient are 0 either way.
    x = jnp.where(keep[..., None], hidden, 0).reshape(n, hidden.shape[-1])  # [n, d_model]
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, -1)  # [n_chunks, chunk, d_model]
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, chunk_size)  # [n_chunks, chunk]
    k = jnp.pad(keep.reshape(n), (0, pad)).reshape(n_chunks, chunk_size)  # [n_chunks, chunk], padding False
    return x, t, k, keep


def chunk_positions(vocab_size: int) -> int:
    """`chunked_cross_entropy`'s default chunk: as many positions as make `CHUNK_BYTES` of
    float32 logits `[positions, vocab_size]`, at least one."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def _per_position(logits: jax.Array, targets: jax.Array, keep: jax.Array, smoothing: float) -> jax.Array:
    """`(1 - e) * -log p[target] + e * mean_c(-log p[c])` `[...]` float32 at each kept position
    of `logits` `[..., V]` (log-softmax in float32), NaN at a kept id outside `[0, V)`, and
    0.0 with a zero gradient where `keep` `[...]` is False, whatever the logits hold there."""
    vocab = logits.shape[-1]
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
    return jnp.where(keep, per_position, 0.0)  # [...]


def _kept(targets: jax.Array, ignore_id: int | None) -> jax.Array:
    """bool `[...]`: the positions the loss scores, those whose target is not `ignore_id`."""
    return jnp.ones(targets.shape, bool) if ignore_id is None else targets != ignore_id


def _count(keep: jax.Array) -> jax.Array:
    """float32 `[]`: the number of kept positions, the mean's divisor; max(n, 1): with nothing
    kept the sum is 0 and so is the mean, not 0 / 0."""
    return jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)


def _check_targets(name: str, targets: jax.Array, vocab: int, ignore_id: int | None) -> None:
    """Raises, naming the function `name`, unless `targets` holds integers and (when concrete)
    every one that is not `ignore_id` lies in `[0, vocab)`."""
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{name}: targets must hold integer ids, got dtype {targets.dtype}")
    if is_traced(targets):
        return
    targets = np.asarray(targets)
    kept = targets if ignore_id is None else targets[targets != ignore_id]
    bad = kept[(kept < 0) | (kept >= vocab)]
    if bad.size:
        raise ValueError(
            f"{name}: targets hold ids outside [0, V={vocab}) that are "
            f"not ignore_id={ignore_id!r}: e.g. {int(bad[0])}")
