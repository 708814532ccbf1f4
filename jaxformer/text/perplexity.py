"""A model's perplexity on a text's ids, by the sliding-window procedure transformers
documents for fixed-length models (`jaxformer-perplexity` is the command over it).

Windows of up to `window` ids begin at 0, stride, 2 stride, ...; each scores only the ids
past the previous window's end (the ones before are context), and the last window is the
first that reaches the end. A window's loss is the mean negative log-likelihood of its scored
ids, each predicted from the ids before it in the window (the window's first id is never
predicted), and the windows are combined weighted by their number of targets less one, as
transformers' recipe does (it subtracts one label a window for the shift inside its loss):

    perplexity = exp( sum_w loss_w * (n_w - 1) / sum_w (n_w - 1) ),   n_w = end_w - end_{w-1}

With `stride == window` the windows do not overlap; a smaller stride gives each scored id
more context. docs/text.md, "Perplexity", says more.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decoder import Decoder
from jaxformer.validation import NotFinite, as_int, why_not_finite


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """What `perplexity` measured.

    Attributes:
      perplexity: `exp(nll)`.
      nll: the weighted mean negative log-likelihood (module docstring).
      tokens: the ids of the text.
      windows: the windows evaluated.
    """

    perplexity: float
    nll: float
    tokens: int
    windows: int


def window_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(begin, end, targets)` of each window over `n` ids: ids `[begin, end)` are read and
    the last `targets` of them scored (those past the previous window's end)."""
    spans, previous_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        spans.append((begin, end, end - previous_end))
        previous_end = end
        if end == n:
            break
    return spans


def perplexity(model: Decoder, params, ids, window: int, stride: int) -> Perplexity:
    """The sliding-window perplexity of `ids` (module docstring), one compiled program for
    every window: the last, shorter one is padded, its padding never scored.

    Args:
      model: a `Decoder`.
      params: its parameters.
      ids: the text's token ids, at least 2, in `[0, vocab_size)`.
      window: ids a window reads, at most the model's `max_seq_len`.
      stride: how far each window begins after the one before, in `[1, window]`.

    Raises:
      ValueError: naming the argument, before anything is compiled.
      NotFinite: a window's NLL, or the perplexity, is NaN or inf (naming the window and
        the cause: weights that hold NaN or inf, or logits that overflowed).
    """
    ids = np.asarray(ids)
    config = model.config
    as_int(window, "window", minimum=2, maximum=config.max_seq_len, maximum_name="the model's max_seq_len")
    as_int(stride, "stride", minimum=1, maximum=window, maximum_name="window")
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"ids must be a 1-D sequence of at least 2 token ids (got shape {ids.shape})")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"ids must lie in [0, vocab_size={config.vocab_size}) (got {ids.min()} .. {ids.max()})")
    total, weights = 0.0, 0
    spans = window_spans(len(ids), window, stride)
    for begin, end, targets in spans:
        row = np.zeros((1, window), np.int32)
        row[0, :end - begin] = ids[begin:end]
        # Position t predicts id t + 1; the scored ids are the window's last `targets`, never its first.
        first = max(end - begin - targets, 1)
        scored = (np.arange(1, window) >= first) & (np.arange(1, window) < end - begin)  # [window - 1]
        weight = targets - 1  # transformers' count: the targets less the one its shift drops
        if weight == 0:
            continue  # a last window of one target: weight 0 (transformers' loss there is 0/0)
        nll_sum, count = jax.device_get(_window_nll(model, params, jnp.asarray(row), jnp.asarray(scored)))
        mean = float(nll_sum) / float(count)
        if not math.isfinite(mean):
            raise NotFinite(f"the mean NLL of the window over ids [{begin}, {end}) is {mean}, not a result: "
                            f"{why_not_finite({'the weights': params}, config.dtype)}")
        total += mean * weight
        weights += weight
    nll = total / weights
    if nll >= math.log(np.finfo(np.float64).max):
        raise NotFinite(f"the perplexity exp({nll:.6g}) overflows, not a result: the model gives the text almost no "
                        "probability")
    return Perplexity(perplexity=math.exp(nll), nll=nll, tokens=len(ids), windows=len(spans))


@functools.partial(jax.jit, static_argnums=0)
def _window_nll(model: Decoder, params, row: jax.Array, scored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The summed NLL of the ids `scored` marks in `row [1, window]` (entry t: id t + 1,
    predicted at t), and their count."""
    logits, _ = model.apply({"params": params}, row)  # [1, window, vocab]
    log_probs = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # [window - 1, vocab]
    nll = -jnp.take_along_axis(log_probs, row[0, 1:, None], axis=-1)[:, 0]  # [window - 1]
    return jnp.sum(jnp.where(scored, nll, 0.0)), jnp.sum(scored)
