"""What a model provides to decoding: one small interface, so that no decoding strategy
asks which model it drives.

Both models implement it: `Decoder` continues its prompt; `VanillaTransformer` encodes
its prompt (the source) once and starts its decoder from BOS. The protocol lives below the
models and below `jaxformer.decoding`: a model imports this module, never the decoding
package, and decoding reads what a model can do from its `DecodingSpec`, never its class.
"""

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
      prompt_vocab_size: the prompt's ids lie in `[0, prompt_vocab_size)`.
      vocab_size: the model emits ids in `[0, vocab_size)`.
      max_seq_len: the longest prompt, and the longest decoder prompt plus new tokens.
      pad_id: the default filler after EOS.
      ragged_prompts: prompts of different lengths may share a batch (`prompt_lengths`).
      supports_speculative: the decoder's input is the prompt itself and a step of T
        tokens scores all T (so proposals can be checked in one pass, and the prompt's own
        tokens looked up): speculative decoding may drive it, or use it as a draft.
      prefill_bytes: `(batch, prompt_len, capacity) -> bytes`, the most memory the
        prefill of `batch` rows of `prompt_len` tokens into a cache of `capacity` positions
        holds at once (`jaxformer.memory.prefill_bytes`): a run that cannot fit in the free
        memory is refused before it is compiled. None: the model gives no estimate.
    """

    prompt_vocab_size: int
    vocab_size: int
    max_seq_len: int
    pad_id: int
    ragged_prompts: bool
    supports_speculative: bool = False
    prefill_bytes: Callable[[int, int, int], int] | None = None


class Decodable(Protocol):
    """A model the decoding strategies (`jaxformer.decoding`) can drive.

    The first three are plain methods (marked `nn.nowrap`); the last two are called
    through `model.apply({"params": params}, ..., method=...)`.
    """

    def decoding_spec(self) -> DecodingSpec:
        """Vocabularies, length limit, default padding, what decoding may do with it."""

    def decoder_prompt(self, prompt: np.ndarray, bos_id: int | None) -> np.ndarray:
        """The decoder's first input `[batch, P]`: the prompt itself, or one BOS column."""

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty `KVCache` of `capacity` positions for `batch_size` rows. Decoding sets
        each row's `pos`, places it on a mesh, and beam search reorders its batch-first
        leaves."""

    def decode_context(self, prompt: jax.Array) -> Any:
        """What every step reads besides the cache, computed once per prompt."""

    def decode_step(self, tokens: jax.Array, cache: Any, context: Any) -> tuple[jax.Array, Any]:
        """`tokens [batch, T]` -> `(logits [batch, T, vocab], cache)`: row b's tokens at its
        positions `cache.pos[b] ..`, and the cache advanced by T in every row."""
