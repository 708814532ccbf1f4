"""Memory: what a decoder's prefill needs, from its shapes alone, and what the devices have free.

A prompt within `max_seq_len` can still need more memory than there is; `check_fits`
refuses it on the host, before anything is traced (docs/decoding.md, "Prompts that do not
fit in memory", gives the sizes and what XLA does otherwise).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from jaxformer.blockwise import BLOCK, in_blocks_for
from jaxformer.config import DecoderConfig
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.experts import ExpertsSpec

# The files where Linux reports a cgroup's memory limit and use (v2, then v1): in a
# container the limit, not the host's memory, is what a process can have.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


# Work this small is not checked (`check_fits`).
UNCHECKED_BYTES = 64 << 20


def prefill_bytes(config: DecoderConfig, batch: int, prompt_len: int, capacity: int) -> int:
    """Bytes a `Decoder` prefill holds at its peak: `batch` rows (every beam) of `prompt_len`
    (T) tokens into a cache of `capacity` (S) positions, from the shapes of `config`.

    The cache and the residual stream live throughout; each block's attention, its feed-forward
    and the logits come in phases XLA frees one by one, so the peak is the largest phase on
    top. The float32 scores `[batch, n_head, T, S]` dominate dense attention (XLA on a CPU
    keeps three such arrays, and the bool mask `[batch, T, S]`); attention in blocks holds one
    block's, `[batch, n_head, 512, 512]`, and the output it builds. The attention and the
    feed-forward are each layer's own (its heads and their width: Gemma 4's global layers' are
    wider; `ffn_bytes`), the largest of them counted. The parameters are not counted: the free
    memory excludes them. (With per-layer inputs, `[batch, T, n_layer, width]` live throughout too.)
    """
    c = config
    rows = batch * prompt_len  # the positions every activation has
    cache = batch * sum(cache_entry_bytes(entry, capacity, jnp.dtype(c.cache_storage_dtype).itemsize)
                        for entry in c.cache_entries)
    stream = 2 * rows * c.d_model * 4  # [batch, T, d_model]: the stream and its normalised copy
    if c.per_layer_width:
        stream += rows * c.n_layer * c.per_layer_width * 4
    # Each filled layer's mixer (`DecoderConfig.layers`: its own heads), else the attention the fields state for all.
    attention = max((mixer_bytes(c, spec.mixer, batch, prompt_len, capacity) for spec in c.layers),
                    default=mixer_bytes(c, None, batch, prompt_len, capacity))
    # Each filled layer's feed-forward, else the gated MLP the fields state for all.
    ffn = max((ffn_bytes(spec.ffn, rows) for spec in c.layers), default=3 * rows * c.ffn_dim * 4)
    logits = rows * c.vocab_size * 4  # [batch, T, vocab], float32 out of the head's matrix product
    return cache + stream + max(attention, ffn, logits)


def mixer_bytes(config: DecoderConfig, spec, batch: int, prompt_len: int, capacity: int) -> int:
    """Bytes one layer's mixer of `spec` (None: the attention `config`'s fields state) holds in a
    prefill of `batch` rows of `prompt_len` (T) tokens into `capacity` (S) slots, in float32.

    Attention: its scores, `[batch, heads, T, S]` or a block's (`prefill_bytes`), and its q, k, v.
    Latent attention (`LatentAttentionSpec`) attends absorbed over the latent cache: its H heads'
    scores, and per position and head its query, the query's RoPE part, its latent `[r]` and
    `[r | rope]` forms, the output in the latent and in v; the keys `[batch, S, r + rope]` once.
    Gated DeltaNet (`GatedDeltaNetSpec`, chunked over C = min(chunk, T) tokens, the prompt padded to
    n whole chunks, one chunk a step): per value head the four `[C, C]` arrays of one chunk (decays,
    A, its inverse, the scores), four `[d_k]` and four `[d_v]` arrays a position (q and k repeated to
    the value heads, and their copies in chunks; v, its copy in chunks, the output and its copy in
    positions' order), and the projections a position, before and after the convolution; its state a
    few `[d_k, d_v]` arrays."""
    # (The kinds are told apart by what they are, not imported: their modules import the cache, which
    # imports this one. A linear layer's attention type is "linear"; latent attention has a latent.)
    c, T, S = config, prompt_len, capacity
    rows = batch * T
    if spec is not None and spec.attention_type == "linear":
        C = min(spec.chunk, T)
        padded = batch * -(-T // C) * C  # [batch, n * C]
        Hk, Hv, dk, dv = spec.n_key_head, spec.n_value_head, spec.key_dim, spec.value_dim
        chunks = 4 * batch * Hv * C * C * 4 + padded * Hv * (4 * dk + 4 * dv) * 4
        projections = rows * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv) * 4 + rows * (2 * Hk * dk + Hv * dv) * 4
        return chunks + projections + 2 * batch * Hv * dk * dv * 4
    latent = hasattr(spec, "kv_lora_rank")
    attention = c if spec is None or latent else spec  # (GQA's heads: a filled layer's own, else the fields')
    heads = spec.n_head if latent else attention.n_head
    weights_cast = jnp.dtype(c.dtype).itemsize if jnp.dtype(c.dtype).itemsize != 4 else 0  # softmax's, for `@ V`
    if in_blocks_for(c.attention_impl, T, S):  # one block's scores, and the output in float32
        width = spec.kv_lora_rank if latent else attention.head_dim
        scores = batch * heads * min(T, BLOCK) * min(S, BLOCK) * (3 * 4 + weights_cast) + rows * heads * width * 4
    else:  # every score, and the bool mask [batch, T, S]
        scores = batch * heads * T * S * (3 * 4 + weights_cast) + batch * T * S
    if latent:
        r, nope, rope = spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        qkv = rows * heads * (nope + 3 * rope + 3 * r + spec.v_head_dim) * 4 + 2 * batch * S * (r + rope) * 4
    else:
        rope = attention.head_dim
        qkv = 2 * rows * (attention.n_head + 2 * attention.n_kv_head) * attention.head_dim * 4  # q, k, v, rotations
    return scores + qkv + 2 * (S + rows) * (rope // 2) * 4  # the RoPE tables, and the rows read from them


def cache_entry_bytes(entry: tuple, capacity: int, itemsize: int) -> int:
    """Bytes one row of a layer keeps for `entry` (`DecoderConfig.cache_entries`' `(kind, shapes)`):
    a key and a value for each of `capacity` slots, or a linear layer's conv inputs and float32 state."""
    kind, (a, b) = entry
    if kind == "none":  # (a layer that reads another's keys and values)
        return 0
    if kind == "linear":
        return math.prod(a) * itemsize + math.prod(b) * 4
    return capacity * (math.prod(a) + math.prod(b)) * itemsize


def ffn_bytes(spec, rows: int) -> int:
    """Bytes a layer's feed-forward of `spec` holds for `rows` positions, in float32: a gated MLP's
    gate, up and their product, `[rows, width]` each; a mixture of experts' (`ExpertsSpec`) the
    same for each of a token's k experts, `[rows * k, width]` each, with its router's logits
    `[rows, E]`, and its shared expert's, as a gated MLP's, where it has one; a gated MLP and experts
    side by side (`DenseAndExpertsSpec`), both."""
    if isinstance(spec, DenseAndExpertsSpec):
        return ffn_bytes(spec.dense, rows) + ffn_bytes(spec.experts, rows)
    if not isinstance(spec, ExpertsSpec):
        return 3 * rows * spec.width * 4
    shared = 0 if spec.shared is None else ffn_bytes(spec.shared, rows)
    return 3 * rows * spec.top_k * spec.width * 4 + rows * spec.n_experts * 4 + shared


def free_bytes() -> tuple[int, str] | None:
    """`(bytes, where)` free for new arrays on the default backend, None if unknown: on an
    accelerator, `bytes_limit - bytes_in_use` summed over the local devices; on a CPU, the
    host's `MemAvailable` (or a cgroup's limit, if less), else its physical memory, or what
    the process's address-space limit (`ulimit -v`) leaves it, if that is less."""
    devices = jax.local_devices()
    stats = [device.memory_stats() for device in devices]
    if all(s and "bytes_limit" in s for s in stats):
        free = sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return free, f"{len(devices)} {devices[0].platform.upper()} device{'s' * (len(devices) > 1)}"
    known = [n for n in (_meminfo_available(), _cgroup_free()) if n is not None]
    host = (min(known), "the host") if known else _physical_memory()
    # An allocation past the limit fails however much the host has free (XLA: RESOURCE_EXHAUSTED).
    left = _address_space_left()
    if left is not None and (host is None or left[0] < host[0]):
        return left[0], f"the host within this process's address-space limit (ulimit -v: {format_bytes(left[1])})"
    return host


def _physical_memory() -> tuple[int, str] | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host (all of its memory)"
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None


def _address_space_left() -> tuple[int, int] | None:
    """`(bytes left, limit)` of this process's address-space limit (`RLIMIT_AS`, `ulimit -v`):
    the limit less the address space it has mapped (`VmSize`, what the limit counts); None
    without a limit, or where either cannot be read (not Linux)."""
    try:
        import resource  # (Unix only)

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, AttributeError, ValueError, OSError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    text = _read("/proc/self/status")
    try:
        mapped = int(text.split(b"VmSize:", 1)[1].split()[0]) * 1024  # the file counts kB
    except (AttributeError, IndexError, ValueError):
        return None
    return max(limit - mapped, 0), limit


def _read(path: str) -> bytes | None:
    """A small system file's bytes (one unbuffered read: this runs before every `generate`), or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)


def _meminfo_available() -> int | None:
    """`MemAvailable` of `/proc/meminfo` in bytes (Linux), else None."""
    text = _read("/proc/meminfo")
    try:
        return int(text.split(b"MemAvailable:", 1)[1].split()[0]) * 1024  # the file counts kB
    except (AttributeError, IndexError, ValueError):  # no file, no such line
        return None


@functools.cache
def _cgroup_files() -> tuple[str, str] | None:
    """This system's cgroup memory limit and usage files (v2, else v1), or None: looked for once."""
    return next((files for files in CGROUP_FILES if all(os.path.isfile(f) for f in files)), None)


def _cgroup_free() -> int | None:
    """What this process's cgroup limit leaves (its limit less its use), else None."""
    files = _cgroup_files()
    limit, usage = (None, None) if files is None else map(_read, files)
    if not (limit and usage and limit.strip().isdigit() and usage.strip().isdigit()):  # v2 writes "max": no limit
        return None
    return max(int(limit) - int(usage), 0)


def format_bytes(n: int) -> str:
    """`n` bytes in TiB, GiB, MiB or KiB, as a reader takes them in."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} bytes"


def check_fits(needed: int, what: str) -> None:
    """Raises `ValueError`, naming `what`, `needed` bytes and what is free, if they do not fit.

    Work of at most `UNCHECKED_BYTES` is taken without a look: reading what is free would
    cost more than a small model's whole `generate`, and such work fits wherever the model did.
    """
    if needed <= UNCHECKED_BYTES:
        return
    free = free_bytes()
    if free is not None and needed > free[0]:
        raise ValueError(f"{what} needs about {format_bytes(needed)} of memory, more than the "
                         f"{format_bytes(free[0])} free on {free[1]}")
