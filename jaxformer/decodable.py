"""What a model provides to decoding, so that no strategy asks which model it drives
(docs/decoding.md, "What a model provides to decoding"). Models import this module, never
`jaxformer.decoding`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import numpy as np

from jaxformer.cache import KVCache


@dataclasses.dataclass(frozen=True)
class DecodingSpec:
    """The host-side facts decoding checks its inputs against.

    Attributes:
      prompt_vocab_size, vocab_size: the prompt's ids, and the emitted ones, lie below them.
      max_seq_len: the longest prompt, and the longest decoder prompt plus new tokens.
      pad_id: the default filler after EOS.
      ragged_prompts: prompts of different lengths may share a batch (`prompt_lengths`).
      supports_speculative: the decoder continues the prompt itself and a step of T tokens
        scores all T, so speculative decoding may drive it or use it as a draft.
      prefill_bytes: `(batch, prompt_len, capacity) -> bytes`, the prefill's peak; None: no estimate.
      keeps_state: a layer keeps a state of every token it has read (linear attention), so a row
        cannot be set back to an earlier position: no speculative decoding (a round's rejected
        proposals would stay in the state), and a cached prompt is reused only whole.
    """

    prompt_vocab_size: int
    vocab_size: int
    max_seq_len: int
    pad_id: int
    ragged_prompts: bool
    supports_speculative: bool = False
    prefill_bytes: Callable[[int, int, int], int] | None = None
    keeps_state: bool = False


class Decodable(Protocol):
    """A model the decoding strategies can drive; the last two methods are called through
    `model.apply({"params": params}, ..., method=...)`."""

    def decoding_spec(self) -> DecodingSpec:
        """Vocabularies, length limit, default padding, what decoding may do with it."""

    def decoder_prompt(self, prompt: np.ndarray, bos_id: int | None) -> np.ndarray:
        """The decoder's first input `[batch, P]`: the prompt itself, or one BOS column."""

    def init_cache(self, batch_size: int, capacity: int, rewind: int = 0) -> KVCache:
        """An empty `KVCache` of `capacity` positions for `batch_size` rows, whose rows may be
        set back by up to `rewind` positions after a call (a speculative round)."""

    def decode_context(self, prompt: jax.Array) -> Any:
        """What every step reads besides the cache, computed once per prompt."""

    def decode_step(self, tokens: jax.Array, cache: Any, context: Any) -> tuple[jax.Array, Any]:
        """`tokens [batch, T]` -> `(logits [batch, T, vocab], cache)`, row b's at positions
        `cache.pos[b] ..`, the cache advanced by T."""

    # Optional: `decode_last(tokens, cache, context, last)`, `decode_step` for a prompt that gives
    # `(logits [batch, vocab] at each row's position last[b], cache)`, the only ones a prefill reads
    # (a decoder runs its output head on them alone); without it, decode_step's at `last`.
