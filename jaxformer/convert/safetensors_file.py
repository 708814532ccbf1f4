"""One safetensors file, read without copying: its header checked by safetensors' own reader,
each tensor a read-only view of the memory-mapped file in its stored dtype.

safetensors' `get_tensor` copies a tensor into a new buffer (and its flax reader once more,
into an XLA one) before a loader could cast and lay it out, a copy the allocator then tends
to keep. A view costs no memory of the process's own: its pages are the file's page cache,
though counted in RSS as file pages while mapped; `release` gives a tensor's back once the
loader has its copy, so a shard is never resident whole beside the copies made of it.
"""

from __future__ import annotations

import json
import mmap
from typing import Callable, Iterable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

# The dtypes a tensor may be stored in (safetensors' names): the floating ones, and the parts of a
# matrix a checkpoint ships quantized (MXFP4's bytes, FP8's values), which `load_hf` reads as one
# `QArray` (never cast: they need dequantizing).
FLOATING_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
QUANTIZED_DTYPES = {"U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn}
READ_DTYPES = {**FLOATING_DTYPES, **QUANTIZED_DTYPES}


class SafetensorsFile:
    """The tensors of the safetensors file `file`.

    Raises:
      ValueError: naming the file, when safetensors cannot read it (truncated, garbage, a
        header that claims more bytes than the file holds).
    """

    def __init__(self, file: str):
        self.file = file
        try:
            with safe_open(file, framework="numpy") as f:
                self.keys = frozenset(f.keys())
        except SafetensorError as e:  # truncated, garbage, a bad header: the reader says which
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        # The format: an 8-byte little-endian header length, the JSON header (each tensor's
        # dtype, shape and byte range), the data. safe_open has checked it, ranges included.
        with open(file, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, np.uint8)
        self._start = 8 + int.from_bytes(self._data[:8].tobytes(), "little")
        self._header = json.loads(self._data[8:self._start].tobytes())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def tensor(self, key: str) -> np.ndarray:
        """Tensor `key` as a read-only view in its stored dtype; a ValueError naming the file
        and the tensor unless that dtype is one `READ_DTYPES` names."""
        entry = self._header[key]
        if entry["dtype"] not in READ_DTYPES:
            raise ValueError(f"{self.file}: {key} is stored as {entry['dtype']}; only floating tensors "
                             f"({', '.join(FLOATING_DTYPES)}) and shipped quantized ones "
                             f"({', '.join(QUANTIZED_DTYPES)}) load")
        begin, end = entry["data_offsets"]
        return self._data[self._start + begin:self._start + end].view(READ_DTYPES[entry["dtype"]]).reshape(
            entry["shape"])

    def release(self, key: str) -> None:
        """Unmaps the pages of tensor `key`'s bytes from the process (`MADV_DONTNEED`): they
        stop counting in its RSS. A view of them still reads the same bytes, from the file."""
        begin, end = self._header[key]["data_offsets"]
        first = (self._start + begin) // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
        self._map.madvise(mmap.MADV_DONTNEED, first, self._start + end - first)


def write_safetensors(file, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                      read: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file holding one tensor in memory at a time.

    safetensors' own `save_file` takes every tensor at once and copies each into bytes
    before it writes: a model held three times. Here the header is made from the names,
    shapes and dtypes alone, and each tensor is asked for (`read(name)`) and written in turn.

    Args:
      file: the path to write.
      tensors: `(name, shape, dtype)` of each tensor, in the order they are stored; the
        dtype one of `READ_DTYPES`' (a shipped quantized matrix's parts: uint8, float8 e4m3).
      read: `read(name)` -> the tensor, of the shape and dtype given.
      metadata: the header's `__metadata__` strings.

    Raises:
      ValueError: a tensor `read` gives is not the shape or dtype announced.
    """
    names = {np.dtype(v): k for k, v in READ_DTYPES.items()}
    header, offset = {"__metadata__": metadata or {}}, 0
    entries = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in tensors]
    for name, shape, dtype in entries:
        end = offset + int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' writer pads it
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape, dtype in entries:
            w = np.ascontiguousarray(read(name))
            if w.shape != shape or w.dtype != dtype:
                raise ValueError(f"{name}: announced {shape} {dtype}, given {w.shape} {w.dtype}")
            f.write(w.reshape(-1).view(np.uint8).data)  # the bytes as they lie (bfloat16 has no buffer format)
