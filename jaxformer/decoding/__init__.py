"""Decoding: one front door (`generate`, `stream`) over three peer strategies (plain, beam
search, speculative), written against the `Decodable` protocol; see docs/decoding.md."""

from jaxformer.decodable import Decodable, DecodingSpec
from jaxformer.decoding.beam import Beam, beam_search
from jaxformer.decoding.front_door import (
                                           RunStats,
                                           advance,
                                           compile_generate,
                                           finish,
                                           generate,
                                           run,
                                           speculative_generate,
                                           start,
                                           stream,
)
from jaxformer.decoding.plain import Plain, PlainState
from jaxformer.decoding.request import DecodeOptions, DecodeRequest
from jaxformer.decoding.sampling import Sampling, sample_token
from jaxformer.decoding.speculative import Draft, PromptLookup, Speculative
from jaxformer.decoding.steps import NO_TOKEN, NonFiniteLogitsError

__all__ = ["NO_TOKEN", "Beam", "Decodable", "DecodeOptions", "DecodeRequest", "DecodingSpec", "Draft",
           "NonFiniteLogitsError", "Plain", "PlainState", "PromptLookup", "RunStats", "Sampling", "Speculative",
           "advance", "beam_search", "compile_generate", "finish", "generate", "run", "sample_token",
           "speculative_generate", "start", "stream"]
