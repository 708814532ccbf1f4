"""A Llama checkpoint folder as a GGUF file llama.cpp loads, and llama.cpp's own quantizer over it:
the weights `benchmarks.cpu_decode` runs llama.cpp on (the `cpu-peer` extra).

`write_gguf` reads the folder with jaxformer's readers (`config.json` through `load_hf_config`, the
safetensors shards tensor by tensor, one in memory at a time) and writes every tensor in float32
under llama.cpp's names, laid out as llama.cpp reads them:

- a GGUF tensor's dims are numpy's reversed (its first dim is the one that varies fastest), so a
  Linear's `[out, in]` weight is written as it lies: llama.cpp's `{in, out}`;
- llama.cpp's "llama" rotates adjacent channels `(2i, 2i + 1)` of each head, Hugging Face's
  channels `(i, i + head_dim / 2)`: the rows of q and k are reordered head by head
  (`jaxformer.positions.interleaved_to_split_half`, as `jaxformer.convert.with_rope_pairing` moves
  a model between the pairings), which leaves every score `q . k` as it was;
- Llama 3's RoPE scaling is the tensor `rope_freqs.weight`, `[head_dim / 2]`: llama.cpp turns pair
  i by `pos * theta ** (-2i / head_dim) / rope_freqs[i]`, so each entry is how many times longer
  the pair's wavelength is made (`llama3_rope_factors`).

The vocabulary is a synthetic SentencePiece-style one of exactly the model's size (`<unk>`, `<s>`,
`</s>`, the 256 byte tokens, then fillers): the benchmark feeds llama.cpp token ids, never text, so
only the count matters.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections import Counter

import gguf
import numpy as np

from jaxformer.config import DecoderConfig
from jaxformer.convert import load_hf_config
from jaxformer.convert.hf import _read_tensors
from jaxformer.positions import interleaved_to_split_half

# Hugging Face's names inside a layer -> llama.cpp's (`blk.N.` then these).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
ROPE_FREQS = "rope_freqs.weight"
# The formats `quantize_gguf` makes, as llama.cpp's file types (llama.h's `llama_ftype`).
FILE_TYPES = {"BF16": 32, "Q8_0": 7, "Q4_0": 2}
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unknown, BOS, EOS
BYTE_TOKENS = 256  # `<0x00>` .. `<0xFF>`, ids 3 .. 258


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for the Hugging Face Llama tensor `hf_name`; a ValueError naming it otherwise."""
    if hf_name in MODEL_NAMES:
        return MODEL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, the rest
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[2].isdigit() and parts[3] in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES[parts[3]]}"
    raise ValueError(f"{hf_name}: not a tensor of a Llama checkpoint (no GGUF name for it)")


def interleaved_rows(w: np.ndarray, head_dim: int) -> np.ndarray:
    """q's or k's weight `[heads * head_dim, d]` with each head's rows moved from Hugging Face's
    split-half pairing to llama.cpp's interleaved one: interleaved row 2i is split-half row i,
    row 2i + 1 is row i + head_dim / 2."""
    to_interleaved = np.argsort(interleaved_to_split_half(head_dim))  # x_interleaved = x_split_half[..., this]
    return w.reshape(-1, head_dim, w.shape[-1])[:, to_interleaved].reshape(w.shape)


def llama3_rope_factors(config: DecoderConfig) -> np.ndarray:
    """`[head_dim / 2]` float32: by how much Llama 3's RoPE scaling lengthens pair i's wavelength.

    Pair i turns at `theta ** (-2i / head_dim)`, a wavelength `2 pi / that`. With the trained
    context `C` (`original_max_position_embeddings`) and `low < high` its frequency factors:
    a wavelength shorter than `C / high` is kept (1); one longer than `C / low` is `factor`
    times longer; in between the frequency is the blend `(1 - s) / factor + s` of the two, with
    `s = (C / wavelength - low) / (high - low)` going from 0 at `C / low` to 1 at `C / high`,
    so the wavelength is `1 / that` times longer.
    """
    scaling = config.rope_scaling
    context, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    inv_freq = float(config.rope_theta) ** (-np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    wavelength = 2 * np.pi / inv_freq  # [head_dim / 2]
    s = (context / wavelength - low) / (high - low)
    between = 1 / ((1 - s) / scaling.factor + s)
    factors = np.where(wavelength < context / high, 1.0, np.where(wavelength > context / low, scaling.factor, between))
    return factors.astype(np.float32)


def checked_config(folder: str) -> DecoderConfig:
    """The folder's `DecoderConfig`; a ValueError naming the folder unless it is a Llama that
    llama.cpp's "llama" runs as jaxformer does (full attention, RoPE unscaled or Llama 3's)."""
    config = load_hf_config(folder)
    if config.hf_model_type != "llama":
        raise ValueError(f"folder: {folder} holds a {config.hf_model_type!r} checkpoint; write_gguf writes Llama's")
    if config.rope_scaling is not None and config.rope_scaling.kind != "llama3":
        raise ValueError(f"folder: {folder}'s rope_scaling is {config.rope_scaling.kind!r}; write_gguf writes "
                         "Llama 3's (llama3) or none")
    return config


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` tokens llama.cpp accepts: its texts, scores and
    types (`<unk>`, `<s>`, `</s>`, the byte tokens, then fillers that no text makes)."""
    if size < len(SPECIALS) + BYTE_TOKENS:
        raise ValueError(f"vocab_size must be at least {len(SPECIALS) + BYTE_TOKENS} for the synthetic vocabulary "
                         f"(its special and byte tokens), got {size}")
    texts = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(BYTE_TOKENS))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * BYTE_TOKENS]
    fillers = size - len(texts)
    texts += [f"[{i}]" for i in range(fillers)]
    types += [gguf.TokenType.NORMAL] * fillers
    scores = [0.0] * (size - fillers) + [-float(i) for i in range(fillers)]  # (SentencePiece: likelier first)
    return texts, scores, [int(t) for t in types]


def write_metadata(writer: gguf.GGUFWriter, config: DecoderConfig, name: str) -> None:
    """The hyperparameters llama.cpp's "llama" reads, and the synthetic vocabulary."""
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.norm_eps))
    writer.add_vocab_size(config.vocab_size)
    texts, scores, types = vocabulary(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(texts)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(folder: str, path: str) -> str:
    """Writes the Llama checkpoint `folder` as the float32 GGUF file `path`; returns `path`.

    Raises:
      ValueError: `folder` is not a Llama checkpoint llama.cpp's "llama" runs (naming why), or
        holds a tensor no Llama has.
    """
    config = checked_config(folder)
    writer = gguf.GGUFWriter(path, "llama")
    write_metadata(writer, config, os.path.basename(os.path.normpath(folder)))
    factors = llama3_rope_factors(config) if config.rope_scaling is not None else None
    if factors is not None:
        writer.add_tensor_info(ROPE_FREQS, factors.shape, np.dtype(np.float32), factors.nbytes)
    kept = set()  # (the views are mapped, not read: nothing is in memory yet)
    for hf_name, w, _ in _read_tensors(folder):
        if hf_name == "lm_head.weight" and config.tie_embeddings:
            continue  # a tied head is the embedding: llama.cpp uses token_embd when `output` is absent
        kept.add(hf_name)
        writer.add_tensor_info(gguf_name(hf_name), w.shape, np.dtype(np.float32), math.prod(w.shape) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if factors is not None:
        writer.write_tensor_data(factors)
    for hf_name, w, release in _read_tensors(folder):  # the same order as declared
        if hf_name not in kept:
            continue
        w = np.asarray(w, np.float32)  # (a bfloat16 checkpoint widens exactly)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = interleaved_rows(w, config.head_dim)
        writer.write_tensor_data(w)
        del w
        release()
    writer.close()
    return path


def tensor_types(path: str) -> dict[str, str]:
    """Each tensor of the GGUF file `path` and its type's name ("F32", "Q4_0", ...)."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def tensor_bytes(path: str) -> int:
    """The bytes of the GGUF file `path`'s tensors (its weights, without the header)."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def quantize_gguf(src: str, dst: str, fmt: str, threads: int = 2) -> dict[str, str]:
    """Writes `src` (a GGUF file) in `fmt` ("BF16", "Q8_0", "Q4_0") as `dst`, with llama.cpp's own
    quantizer, every matrix in `fmt` (`pure`: the token embedding, which is the tied head, too;
    the norms and `rope_freqs` stay float32, as llama.cpp keeps every vector). Prints and returns
    each tensor's type in `dst`.

    Raises:
      ValueError: `fmt` is not one of `FILE_TYPES`.
      RuntimeError: llama.cpp's quantizer failed.
    """
    import llama_cpp

    if fmt not in FILE_TYPES:
        raise ValueError(f"fmt must be one of {sorted(FILE_TYPES)}, got {fmt!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = FILE_TYPES[fmt], True, threads
    with quiet_llama_cpp():
        failed = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama.cpp's quantizer could not write {dst} in {fmt} from {src}")
    types = tensor_types(dst)
    print(f"{os.path.basename(dst)}: " + ", ".join(f"{n} {t}" for t, n in sorted(Counter(types.values()).items())),
          flush=True)
    return types


class quiet_llama_cpp:
    """A `with` block inside which llama.cpp's log lines (one per tensor as it quantizes) are dropped."""

    def __enter__(self):
        import llama_cpp

        self._drop = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # (kept alive while set)
        llama_cpp.llama_log_set(self._drop, ctypes.c_void_p())
        return self

    def __exit__(self, *exc):
        import llama_cpp

        llama_cpp.llama_log_set(ctypes.cast(None, llama_cpp.llama_log_callback), ctypes.c_void_p())
        return False
