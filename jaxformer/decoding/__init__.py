"""Decoding: `generate` (one jitted loop), `stream` (a token at a time), beam search,
speculative decoding (`PromptLookup`, `Draft`) and the sampling rule, written against
the `Decodable` protocol both models implement."""

from jaxformer.decoding.beam_search import beam_search
from jaxformer.decoding.inputs import DecodeOptions, DecodeRequest
from jaxformer.decoding.loop import decode_loop, decode_rest, generate, stream, stream_start, stream_step
from jaxformer.decoding.protocol import Decodable, DecodingSpec
from jaxformer.decoding.sampling import Sampling, sample_token
from jaxformer.decoding.speculative import Draft, PromptLookup, speculative_generate
from jaxformer.decoding.steps import NO_TOKEN, NonFiniteLogitsError

__all__ = ["NO_TOKEN", "Decodable", "DecodeOptions", "DecodeRequest", "DecodingSpec", "Draft", "NonFiniteLogitsError",
           "PromptLookup", "Sampling", "beam_search", "decode_loop", "decode_rest", "generate", "sample_token",
           "speculative_generate", "stream", "stream_start", "stream_step"]
