"""A decoding run's inputs, checked once on the host before anything is traced.

`DecodeRequest.create` is the one place that checks `generate`'s and `stream`'s
arguments (raising `ValueError`s that name the argument and the limit), that refuses a
prefill the memory free cannot hold, and that turns a ragged batch into the left-padded
one the cache reads.
"""

from __future__ import annotations

import functools
from typing import Sequence, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.decoding.protocol import Decodable, DecodingSpec
from jaxformer.decoding.sampling import Sampling
from jaxformer.memory import check_fits
from jaxformer.validation import (as_int, check_positions_fit, check_token_ids, check_token_layout,
                                  finite_float, per_row)


class DecodeOptions(TypedDict, total=False):
    """The keywords of `generate` and `stream`.

    Attributes:
      max_new_tokens: tokens to generate, >= 1 (required). The decoder's prompt plus the
        new tokens must fit `config.max_seq_len`.
      key: PRNG key (`jax.random.key(seed)`); required when a temperature is > 0. The same
        key gives the same tokens.
      temperature: 0 for greedy argmax, > 0 to sample from `softmax(logits / temperature)`.
        A scalar, or one value per row (as are `top_k` and `top_p`).
      top_k: sample only among the k most likely tokens, `1 <= top_k <= vocab`; None keeps
        them all.
      top_p: nucleus sampling: only among the most likely tokens whose probability adds up
        to `top_p`, in `(0, 1]`; None (or 1) keeps them all.
      eos_id: a row that produces it is finished: it emits `pad_id` afterwards, and the
        loop stops once every row is finished. A sequence of ids stops at any of them
        (Llama 3 checkpoints name several). None never stops early.
      pad_id: filler after EOS; defaults to the model's padding id (the encoder-decoder's
        `config.pad_id`), else 0.
      bos_id: the encoder-decoder's first decoder token (required for it, unused otherwise).
      prompt_lengths: decoder-only: each row's prompt length, `1 .. prompt_len`, for a
        batch of prompts of different lengths, right-padded (what follows a row's length
        is ignored). Each row then decodes as it would alone. None: every row is full.
      num_beams: `generate` only: 1 decodes greedily or samples; > 1 runs beam search
        (deterministic: the temperature must be 0, top-k and top-p unset) and returns
        each row's best beam.
      length_penalty: beam search's exponent in `((5 + length) / 6) ** length_penalty`,
        >= 0; a finished beam scores `log p / that`. 0 compares raw log-probabilities.
    """

    max_new_tokens: int
    key: jax.Array | None
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_id: int | Sequence[int] | None
    pad_id: int | None
    bos_id: int | None
    prompt_lengths: object
    num_beams: int
    length_penalty: float


@struct.dataclass
class DecodeRequest:
    """One decoding run, checked: arrays (traced, so new values reuse the compiled loop)
    and the two sizes that shape the program (static).

    Attributes:
      prompt: int32 `[batch, prompt_len]`, ragged rows moved to the right end (left padding).
      decoder_prompt: int32 `[batch, P]`, the decoder's first input (`Decodable.decoder_prompt`).
      start: int32 `[batch]`, each row's first real slot (its left padding), 0 when full.
      sampling: each row's `Sampling` settings.
      key: the PRNG key; step i samples with `fold_in(key, i)`.
      eos_id: int32 `[n_eos]`, the ids that finish a row (`[-1]` for none).
      pad_id: int32 scalar.
      length_penalty: float32 scalar, beam search's exponent.
      max_new_tokens: tokens to generate (static).
      num_beams: 1, or the beams per row (static).
    """

    prompt: jax.Array
    decoder_prompt: jax.Array
    start: jax.Array
    sampling: Sampling
    key: jax.Array
    eos_id: jax.Array
    pad_id: jax.Array
    length_penalty: jax.Array
    max_new_tokens: int = struct.field(pytree_node=False)
    num_beams: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def create(cls, model: Decodable, prompt, *, max_new_tokens: int, key: jax.Array | None = None,
               temperature=0.0, top_k=None, top_p=None, eos_id: int | Sequence[int] | None = None,
               pad_id: int | None = None,
               bos_id: int | None = None, prompt_lengths=None, num_beams: int = 1,
               length_penalty: float = 0.0) -> "DecodeRequest":
        """Checks a run's arguments (see `DecodeOptions`) against `model.decoding_spec()`.

        Integral arguments may be numpy ints and numbers numpy floats: they are read as
        Python numbers, so `max_new_tokens=np.int64(3)` reuses the program compiled for 3.

        Returns:
          The `DecodeRequest`.

        Raises:
          ValueError: naming the argument and its limit; or a prefill that needs more
            memory than is free (`check_prefill_memory`), naming the prompt length.
        """
        spec = model.decoding_spec()
        prompt, start = _left_padded(prompt, prompt_lengths, spec.prompt_vocab_size, spec.ragged_prompts)
        batch, prompt_len = prompt.shape
        max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1)
        num_beams, length_penalty = _check_beams(num_beams, length_penalty, temperature, top_k, top_p)
        def token_id(value, name):
            return as_int(value, name, minimum=0, maximum=spec.vocab_size - 1, maximum_name="vocab_size - 1")

        pad_id, bos_id = (None if value is None else token_id(value, name)
                          for name, value in (("pad_id", pad_id), ("bos_id", bos_id)))
        eos_ids = _eos_ids(eos_id, token_id)
        decoder_prompt = np.asarray(model.decoder_prompt(prompt, bos_id), np.int32)
        check_positions_fit(0, prompt_len, spec.max_seq_len, "prompt length", "max_seq_len")
        check_positions_fit(decoder_prompt.shape[1], max_new_tokens, spec.max_seq_len,
                            "decoder prompt length + max_new_tokens", "max_seq_len")
        # The cache `steps.prefill` makes: the prompt and every new token but the last.
        check_prefill_memory(spec, batch * num_beams, decoder_prompt.shape[1],
                             decoder_prompt.shape[1] + max_new_tokens - 1)
        sampling = Sampling.create(batch, spec.vocab_size, temperature, top_k, top_p)
        if key is None:
            if sampling.samples.any():
                raise ValueError("key is required when temperature > 0: pass key=jax.random.key(seed)")
            key = _unused_key()
        # Host arrays: the jitted loop takes them as they are, without a dispatch for each.
        return cls(prompt=prompt, decoder_prompt=decoder_prompt, start=start, sampling=sampling, key=key,
                   eos_id=np.asarray(eos_ids, np.int32), pad_id=np.int32(spec.pad_id if pad_id is None else pad_id),
                   length_penalty=np.float32(length_penalty), max_new_tokens=max_new_tokens, num_beams=num_beams)

    def repeat_rows(self, n: int) -> "DecodeRequest":
        """Every row as `n` adjacent rows (one per beam)."""
        def repeat(x):
            return jnp.repeat(x, n, axis=0) if x.ndim else x

        return self.replace(prompt=repeat(self.prompt), decoder_prompt=repeat(self.decoder_prompt),
                            start=repeat(self.start), sampling=jax.tree.map(repeat, self.sampling))


@functools.cache
def _unused_key() -> jax.Array:
    """A greedy run's key: never drawn from, it keeps the traced signature fixed (made once)."""
    return jax.random.key(0)


def _left_padded(prompt, prompt_lengths, vocab_size: int, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """Checks the prompt; returns it int32 with each row's real tokens at the right end
    (so every row's next token goes to the same cache slot), and each row's first real slot."""
    prompt = np.asarray(prompt)
    check_token_layout(prompt, "prompt")
    if prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape {prompt.shape}")
    batch, prompt_len = prompt.shape
    lengths = np.full(batch, prompt_len, np.int32)
    if prompt_lengths is not None:
        if not ragged:
            raise ValueError("prompt_lengths is for the decoder-only model; an encoder-decoder's source "
                             "is right-padded with pad_id")
        given = per_row(prompt_lengths, batch, "prompt_lengths", np.float64)
        if not np.all((given >= 1) & (given <= prompt_len) & (given == np.round(given))):
            raise ValueError(f"prompt_lengths must be ints in [1, prompt_len={prompt_len}], got {given.tolist()}")
        lengths = given.astype(np.int32)
    # Only the real tokens must be ids: what follows a row's length is ignored.
    prompt = np.where(np.arange(prompt_len)[None, :] < lengths[:, None], prompt, 0)
    check_token_ids(prompt, vocab_size, "prompt")
    start = (prompt_len - lengths).astype(np.int32)  # [batch]
    source = np.arange(prompt_len)[None, :] - start[:, None]  # [batch, prompt_len], where each slot reads from
    prompt = np.where(source >= 0, np.take_along_axis(prompt, np.maximum(source, 0), axis=1), 0)
    return prompt.astype(np.int32), start


def check_prefill_memory(spec: DecodingSpec, batch: int, prompt_len: int, capacity: int) -> None:
    """Refuses a prefill that cannot fit in the memory free (`jaxformer.memory.check_fits`),
    for a model that estimates its prefill (`DecodingSpec.prefill_bytes`).

    Args:
      spec: the model's `decoding_spec()`.
      batch: rows, every beam of every prompt.
      prompt_len: the decoder's prompt length, fed in one call.
      capacity: the cache's positions.

    Raises:
      ValueError: naming the prompt length, the rows, the cache, what it needs and what is free.
    """
    if spec.prefill_bytes is None:
        return
    check_fits(spec.prefill_bytes(batch, prompt_len, capacity),
               f"the prefill of a {prompt_len:,}-token prompt ({batch:,} row{'s' * (batch != 1)}, a cache of "
               f"{capacity:,} positions)")


def _eos_ids(eos_id, token_id) -> list[int]:
    """`eos_id` (None, an id, or a sequence of ids) as a non-empty list of checked ids;
    `[-1]`, which no token equals, for none."""
    if eos_id is None:
        return [-1]
    if np.ndim(eos_id) == 0:
        return [token_id(eos_id, "eos_id")]
    if np.ndim(eos_id) != 1 or len(eos_id) == 0:
        raise ValueError(f"eos_id must be an id, a non-empty sequence of ids, or None (got {eos_id!r})")
    return [token_id(value, f"eos_id[{i}]") for i, value in enumerate(eos_id)]


def is_eos(token: jax.Array, eos_id: jax.Array) -> jax.Array:
    """Whether each of `token` (any shape) is one of the ids `eos_id` `[n_eos]`."""
    return jnp.any(token[..., None] == eos_id, axis=-1)


def _check_beams(num_beams, length_penalty, temperature, top_k, top_p) -> tuple[int, float]:
    """`(num_beams, length_penalty)` as Python numbers, checked."""
    num_beams = as_int(num_beams, "num_beams", minimum=1)
    if num_beams > 1 and (np.any(np.asarray(temperature) != 0) or top_k is not None or top_p is not None):
        raise ValueError("beam search is deterministic: with num_beams > 1 leave temperature at 0 "
                         "and top_k, top_p unset")
    penalty = finite_float(length_penalty)
    if penalty is None or penalty < 0:
        raise ValueError(f"length_penalty must be a finite number >= 0 (got {length_penalty!r})")
    return num_beams, penalty
