"""A decoding run's inputs, checked once on the host before anything is traced.

`DecodeRequest.create` is the one place that checks `generate`'s and `stream`'s arguments,
refuses a prefill the free memory cannot hold, and reads a ragged batch's row lengths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.decodable import Decodable, DecodingSpec
from jaxformer.decoding.sampling import Sampling, check_temperature, check_top_k, check_top_p
from jaxformer.memory import check_fits
from jaxformer.validation import as_int, check_positions_fit, check_token_ids, check_token_layout, finite_float, per_row


def _option(default=dataclasses.MISSING, help: str = "", flag_type=None):
    """A `DecodeOptions` field; `flag_type` (int or float) makes it a command-line flag too."""
    return dataclasses.field(default=default, metadata={"help": help, "flag_type": flag_type})


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """A decoding run's options, declared once: `generate`'s, `stream`'s and
    `DecodeRequest.create`'s keywords, and (the fields with a `flag_type`) the text command's
    flags. `check` states each rule that needs no model; docs/decoding.md explains them.

    Attributes:
      max_new_tokens: tokens to generate, >= 1 (required).
      key: PRNG key; required when a temperature is > 0.
      temperature: 0 for greedy argmax, > 0 to sample; a scalar or one per row, as
        `top_k` and `top_p`.
      top_k: sample among the k likeliest tokens, `1 <= top_k <= vocab`; None: all.
      top_p: nucleus sampling's mass, in `(0, 1]`; None (or 1): all.
      eos_id: an id or a sequence of ids that finish a row; None never stops early.
      pad_id: filler after EOS; defaults to the model's padding id.
      bos_id: the encoder-decoder's first decoder token (required for it).
      prompt_lengths: decoder-only: each row's length in a right-padded batch, `1 .. prompt_len`.
      num_beams: `generate` only: > 1 runs beam search (temperature 0, top-k and top-p unset).
      length_penalty: beam search's exponent, >= 0 (0 compares raw log-probabilities).
    """

    max_new_tokens: int = _option(help="tokens to generate after each prompt", flag_type=int)
    key: jax.Array | None = _option(None)
    temperature: float = _option(0.0, "0 decodes greedily; > 0 samples", float)
    top_k: int | None = _option(None, "sample among the k likeliest tokens (default: all)", int)
    top_p: float | None = _option(None, "sample among the likeliest tokens whose probability adds up to p "
                                        "(default: all)", float)
    eos_id: int | Sequence[int] | None = _option(None)
    pad_id: int | None = _option(None)
    bos_id: int | None = _option(None)
    prompt_lengths: object = _option(None)
    num_beams: int = _option(1, "> 1: beam search (deterministic)", int)
    length_penalty: float = _option(0.0, "beam search: a finished beam scores log p / ((5 + length) / 6) ** this",
                                    float)

    def check(self, vocab_size: int | None = None, names: dict[str, str] | None = None) -> None:
        """Raises `ValueError`, naming the option and its rule, unless the options that need no model
        hold; `vocab_size` (for `top_k`) may be None, not known yet; `names` are the caller's own
        for the fields (a command line's flags)."""
        def name(field: str) -> str:
            return (names or {}).get(field, field)

        as_int(self.max_new_tokens, name("max_new_tokens"), minimum=1)
        check_temperature(self.temperature, name=name("temperature"))
        check_top_k(self.top_k, vocab_size, name=name("top_k"))
        check_top_p(self.top_p, name=name("top_p"))
        if as_int(self.num_beams, name("num_beams"), minimum=1) > 1 and (
                np.any(np.asarray(self.temperature) != 0) or self.top_k is not None or self.top_p is not None):
            raise ValueError(f"beam search is deterministic: with {name('num_beams')} > 1 leave {name('temperature')} "
                             f"at 0 and {name('top_k')}, {name('top_p')} unset")
        penalty = finite_float(self.length_penalty)
        if penalty is None or penalty < 0:
            raise ValueError(f"{name('length_penalty')} must be a finite number >= 0 (got {self.length_penalty!r})")

    def sampling(self, batch: int, vocab_size: int) -> Sampling:
        """The sampling settings as `Sampling` for `batch` rows, checked (`Sampling.create`)."""
        return Sampling.create(batch, vocab_size, self.temperature, self.top_k, self.top_p)

    def keywords(self) -> dict:
        """The options as `generate`'s keywords."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


# The options a command line offers as flags, in `DecodeOptions`' order.
FLAGS = tuple(field for field in dataclasses.fields(DecodeOptions) if field.metadata["flag_type"] is not None)


@struct.dataclass
class DecodeRequest:
    """One decoding run, checked: arrays (traced, so new values reuse the compiled loop) and the
    two sizes that shape the program (static).

    Attributes:
      prompt: int32 `[batch, prompt_len]`, each row's tokens from the left, 0 past its length.
      decoder_prompt: int32 `[batch, P]`, the decoder's first input (`Decodable.decoder_prompt`).
      lengths: int32 `[batch]`, each row's real tokens in `decoder_prompt`: its cache position
        after the prefill.
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
    lengths: jax.Array
    sampling: Sampling
    key: jax.Array
    eos_id: jax.Array
    pad_id: jax.Array
    length_penalty: jax.Array
    max_new_tokens: int = struct.field(pytree_node=False)
    num_beams: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def create(cls, model: Decodable, prompt, **options) -> "DecodeRequest":
        """Checks a run's options (`DecodeOptions`' fields, as keywords) against `model.decoding_spec()`:
        `TypeError` for an unknown keyword or no `max_new_tokens`, `ValueError` naming the
        argument and its limit (or the memory). Numbers are read as docs/architecture.md's
        "Checked inputs" says, so `max_new_tokens=np.int64(3)` reuses the program built for 3."""
        o = DecodeOptions(**options)
        spec = model.decoding_spec()
        prompt, lengths = _checked_prompt(prompt, o.prompt_lengths, spec.prompt_vocab_size, spec.ragged_prompts)
        batch, prompt_len = prompt.shape
        o.check(spec.vocab_size)
        max_new_tokens, num_beams = as_int(o.max_new_tokens, "max_new_tokens"), as_int(o.num_beams, "num_beams")

        def token_id(value, name):
            return as_int(value, name, minimum=0, maximum=spec.vocab_size - 1, maximum_name="vocab_size - 1")

        pad_id, bos_id = (None if value is None else token_id(value, name)
                          for name, value in (("pad_id", o.pad_id), ("bos_id", o.bos_id)))
        eos_ids = _eos_ids(o.eos_id, token_id)
        decoder_prompt = np.asarray(model.decoder_prompt(prompt, bos_id), np.int32)
        if o.prompt_lengths is None:  # (a ragged prompt is the decoder's own: `ragged_prompts`)
            lengths = np.full(batch, decoder_prompt.shape[1], np.int32)
        check_positions_fit(0, prompt_len, spec.max_seq_len, "prompt length", "max_seq_len")
        check_positions_fit(decoder_prompt.shape[1], max_new_tokens, spec.max_seq_len,
                            "decoder prompt length + max_new_tokens", "max_seq_len")
        # The cache `steps.prefill` makes: the prompt and every new token but the last.
        check_prefill_memory(spec, batch * num_beams, decoder_prompt.shape[1],
                             decoder_prompt.shape[1] + max_new_tokens - 1)
        sampling = o.sampling(batch, spec.vocab_size)
        key = o.key
        if key is None:
            if sampling.samples.any():
                raise ValueError("key is required when temperature > 0: pass key=jax.random.key(seed)")
            key = _unused_key()
        # Host arrays: the jitted loop takes them as they are, without a dispatch for each.
        return cls(prompt=prompt, decoder_prompt=decoder_prompt, lengths=lengths, sampling=sampling, key=key,
                   eos_id=np.asarray(eos_ids, np.int32), pad_id=np.int32(spec.pad_id if pad_id is None else pad_id),
                   length_penalty=np.float32(o.length_penalty), max_new_tokens=max_new_tokens, num_beams=num_beams)

    def repeat_rows(self, n: int) -> "DecodeRequest":
        """Every row as `n` adjacent rows (one per beam)."""
        def repeat(x):
            return jnp.repeat(x, n, axis=0) if x.ndim else x

        return self.replace(prompt=repeat(self.prompt), decoder_prompt=repeat(self.decoder_prompt),
                            lengths=repeat(self.lengths), sampling=jax.tree.map(repeat, self.sampling))


@functools.cache
def _unused_key() -> jax.Array:
    """A greedy run's key: never drawn from, it keeps the traced signature fixed (made once)."""
    return jax.random.key(0)


def _checked_prompt(prompt, prompt_lengths, vocab_size: int, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """The prompt checked, int32 with 0 past each row's length (what follows need not be an
    id), and each row's length."""
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
    prompt = np.where(np.arange(prompt_len)[None, :] < lengths[:, None], prompt, 0)
    check_token_ids(prompt, vocab_size, "prompt")
    return prompt.astype(np.int32), lengths


def check_prefill_memory(spec: DecodingSpec, batch: int, prompt_len: int, capacity: int) -> None:
    """Refuses a prefill of `batch` rows (every beam) of `prompt_len` tokens into a cache of
    `capacity` positions that the free memory cannot hold, for a model that estimates it."""
    if spec.prefill_bytes is None:
        return
    check_fits(spec.prefill_bytes(batch, prompt_len, capacity),
               f"the prefill of a {prompt_len:,}-token prompt ({batch:,} row{'s' * (batch != 1)}, a cache of "
               f"{capacity:,} positions)")


def _eos_ids(eos_id, token_id) -> list[int]:
    """`eos_id` (None, an id, or ids) as a non-empty list of checked ids; `[-1]`, no token, for none."""
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
