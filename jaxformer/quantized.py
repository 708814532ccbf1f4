"""Quantized weights: a matrix held as narrow numbers and the scales that map them back.

A quantized matrix is a `QArray` (qwix's, Google's JAX quantization library): `qvalue` in a
narrow dtype, `scale` of the same rank, each of its dimensions dividing `qvalue`'s (a scale is
shared by a tile of values), an optional `zero_point` alike, and the `qtype` that says how
`qvalue` reads. In a parameter tree it is a `Quantized`, a `QArray` stored with the matrix's input
axes last (`[out, in]` for the model's `[in, out]`: XLA:CPU multiplies int8 matrices several times
faster that way, docs/precision.md), whose `shape` is still the model's; it stands where the
float matrix stood, sliced by `nn.scan` and indexed per expert like one, and the one weight
product (`jaxformer.products.product`) multiplies it. Its value is

    W = (qvalue - zero_point) * scale        (scale and zero_point repeated over their tile)

with `qvalue` read through the format's code book (NF4's sixteen numbers) where it has one. The
formats, each defined over a matrix's input axes (the ones a product sums over; "the group" is a
run of consecutive inputs along the last of them, within one output channel):

- `int8`: one scale per output channel, `s = max|W| / 127` over its inputs, `q = round(W / s)`
  in [-127, 127].
- `int4`: one scale per group of `group` inputs (64; 32 and 128 allowed; where the last input
  axis is shorter, as o's head channels may be, a group spans its heads). Symmetric: `s =
  max|W| / 7`, `q = round(W / s)` in [-7, 7]; `affine` (GPTQ's and AWQ's integer zero point):
  over the group's range widened to hold 0, `lo = min(min W, 0)`, `hi = max(max W, 0)`, `s = (hi
  - lo) / 15`, `zero_point = round(-lo / s)` and `q = round(W / s) + zero_point`, both in [0, 15]
  (a range off centre, such as an all-positive group's, spends all sixteen levels on it).
- `nf4` (QLoRA's NormalFloat): one scale per group, `s = max|W|`, and `q` the index of the code
  nearest to `W / s` among `NF4`, sixteen quantiles of a normal distribution scaled into [-1, 1].
- `mxfp4` (as gpt-oss ships it, read by `from_mxfp4`, written back by `to_mxfp4`): float4 e2m1
  values, one power of two per 32 inputs. The values are held as their 4-bit codes (uint4, `qtype`
  "mxfp4"), as NF4's are, and decoded from the bits where they are used (`e2m1`): XLA:CPU converts
  a float4 array to float16 before it slices it (docs/precision.md).
- `fp8` (as DeepSeek-V3 and Qwen3's `-FP8` checkpoints ship them, `from_fp8`, `to_fp8`): float8
  e4m3 values, one scale per 128 x 128 block.

`round` is to the nearest, ties to even. Scales are stored in the model's parameter dtype. Which
product each format takes on each platform, and its error, is in docs/precision.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from qwix import QArray
from qwix import dequantize as qwix_dequantize

from jaxformer.sharding import EXPERTS, LAYERS
from jaxformer.validation import as_int

FORMATS = ("int8", "int4", "nf4")  # what `quantize` makes (on load: `load_hf(quantize=...)`)
GROUPS = (32, 64, 128)  # the group sizes int4 and nf4 allow
SHIPPED = ("mxfp4", "fp8")  # read as the checkpoints ship them (`quantization_config.quant_method`)

# The matrices a model's products read, by parameter name: attention's projections (latent and
# linear attention's too) and the feed-forwards' (dense and experts'). The embedding, the output
# head, norms, routers, biases and convolutions stay as they are: small, or read other than by a
# product, and where quantizing costs the most accuracy.
MATRICES = frozenset({"wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "wz", "wb", "wa", "w_gate",
                      "w_up", "w_down"})
# The embedding and the untied output head: quantized only when asked (`Quantization.head`).
HEAD = frozenset({"embed", "lm_head"})
_INPUTS = {"wo": 2}  # o reads heads x channels; every other matrix its first axis

# NF4's code book (Dettmers et al., QLoRA, appendix E): 0, then eight quantiles of N(0, 1) above the
# median and seven below, each side scaled so that its outermost is 1 (tests/test_quantized.py derives
# them again from the normal distribution).
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)

__all__ = ["FORMATS", "GROUPS", "HEAD", "MATRICES", "NF4", "SHIPPED", "QArray", "Quantization", "Quantized",
           "check_group", "dequantize", "dequantize_stored", "stored",
           "e2m1", "format_of", "from_fp8", "frozen_cotangent", "from_mxfp4", "full_scale", "input_axes", "quantize",
           "quantize_params", "to_fp8", "to_mxfp4"]


@struct.dataclass
class Quantized(QArray):
    """A quantized matrix as a parameter tree holds it: the `QArray` of the model's `[lead..., in...,
    out...]` matrix (`lead`: a scanned stack's layers, a mixture's experts) stored as `[lead...,
    out..., in...]`, its last `n_in` axes the inputs. `shape` is the model's; `qvalue.shape` the
    stored one. Leading axes index as an array's (`w[e]`, `nn.scan`'s slices); `stored_order` maps a
    product's letters (or a partition spec) for the model's layout to the stored one's."""

    n_in: int = struct.field(pytree_node=False, default=1)
    n_out: int = struct.field(pytree_node=False, default=1)

    shape = property(lambda self: self._logical(self.qvalue.shape))
    ndim = property(lambda self: self.qvalue.ndim)

    def _logical(self, stored_axes):
        """The model's order of `stored_axes` (a shape, or a product's letters)."""
        lead, k = stored_axes[:-(self.n_in + self.n_out)], len(stored_axes) - self.n_in
        return lead + stored_axes[k:] + stored_axes[len(lead):k]

    def stored_order(self, spec):
        """The stored order of `spec` (a product's letters, a partition spec's tuple: one item per
        axis of the model's `[lead, in, out]`)."""
        lead, k = spec[:-(self.n_in + self.n_out)], len(spec) - self.n_out
        return lead + spec[k:] + spec[len(lead):k]

    def logical(self) -> QArray:
        """The same matrix as a `QArray` in the model's layout `[lead..., in..., out...]`."""
        lead, k = self.ndim - self.n_in - self.n_out, self.ndim - self.n_in
        order = (*range(lead), *range(k, self.ndim), *range(lead, k))
        moved = jax.tree.map(lambda a: jnp.transpose(a, order), self)
        return QArray(moved.qvalue, moved.scale, moved.zero_point, self.qtype)

    def __getitem__(self, index):
        """The matrices at `index` of the leading axes (`w[e]`: expert e's)."""
        lead = self.ndim - self.n_in - self.n_out
        if len(index if isinstance(index, tuple) else (index,)) > lead or index is Ellipsis:
            raise IndexError(f"a quantized matrix indexes its {lead} leading axes alone, got {index!r}")
        return jax.tree.map(lambda a: a[index], self)


def stored(w: QArray, inputs: tuple[int, ...]) -> Quantized:
    """`w` (the model's layout) as a parameter tree holds it, its input axes `inputs` (a run of
    consecutive axes, only outputs after it) moved last."""
    n_out = w.qvalue.ndim - inputs[-1] - 1
    if list(inputs) != list(range(inputs[0], inputs[-1] + 1)):
        raise ValueError(f"a quantized matrix's inputs must be consecutive axes, got {inputs}")
    order = (*range(inputs[0]), *range(inputs[-1] + 1, w.qvalue.ndim), *inputs)
    moved = jax.tree.map(lambda a: jnp.transpose(a, order), w)
    return Quantized(moved.qvalue, moved.scale, moved.zero_point, w.qtype, len(inputs), n_out)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How `quantize` stores a matrix.

    Attributes:
      format: one of `FORMATS`.
      group: int4's and nf4's inputs per scale, one of `GROUPS` (int8's scale covers all of them).
      affine: int4 only: a zero point per group (min..max onto 0..15) instead of a symmetric range.
      head: the embedding and the output head too (`HEAD`): a tied embedding is both, quantized once,
        a scale per vocabulary row over its d_model inputs (its rows looked up dequantized).
    """

    format: str
    group: int = 64
    affine: bool = False
    head: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"quantize must be one of {FORMATS}, got {self.format!r}")
        group = as_int(self.group, "group_size")
        if group not in GROUPS:
            raise ValueError(f"group_size must be one of {GROUPS}, got {self.group!r}")
        object.__setattr__(self, "group", group)
        if self.affine and self.format != "int4":
            raise ValueError(f"affine applies to int4 alone, not {self.format}")


def input_axes(name: str, axes: tuple[str, ...], head: bool = False) -> tuple[int, ...] | None:
    """The axes a product sums over of the parameter `name` whose dimensions are the logical `axes`
    (`jaxformer.sharding`'s names; a scanned stack's `LAYERS` and an expert stack's `EXPERTS` are
    never summed); None: not one of `MATRICES` (nor, with `head`, of `HEAD`)."""
    if head and name == "embed":  # [vocab, d_model]: the tied head's product sums over d_model
        return (1,)
    if name not in MATRICES | (HEAD if head else frozenset()):
        return None
    own = [i for i, axis in enumerate(axes) if axis not in (LAYERS, EXPERTS)]
    return tuple(own[:_INPUTS.get(name, 1)])


def quantize_params(params: dict, axes: dict, how: Quantization, dtype=None) -> dict:
    """`params` with each of `MATRICES` quantized as `how` says, one at a time.

    Args:
      params: a model's parameter tree (float).
      axes: its logical axes, a tree shaped like it (`jaxformer.sharding.param_axes(model)`).
      how: the format.
      dtype: the scales' dtype; None: each matrix's own.

    Returns:
      A new tree: the quantized matrices in their places, every other leaf the same array.
    """
    def one(path, w, names):
        inputs = input_axes(path[-1].key, names, how.head)
        return w if inputs is None else quantize(w, how, inputs, w.dtype if dtype is None else dtype)

    return jax.tree_util.tree_map_with_path(one, params, axes)


def frozen_cotangent(w: QArray) -> QArray:
    """The gradient of a frozen quantized matrix: zeros (float0 for its integer leaves, as JAX
    gives an integer input's)."""
    return jax.tree.map(lambda a: jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.floating)
                        else np.zeros(a.shape, jax.dtypes.float0), w)


def reshape(w: QArray, shape: tuple[int, ...]) -> QArray:
    """`w` with each axis split as `shape` splits it (a checkpoint's `[out, in]` into heads: `[in, H, D]`,
    `[H, D, out]`); each split axis's scale tile narrowed, where it must be, to divide the split's last
    dimension (FP8's 16 inputs a scale in a matrix split into heads of 12: 4), its scales repeated.

    Raises:
      ValueError: `shape` does more than split `w`'s axes.
    """
    groups, new = [], list(shape)
    for n in w.shape:  # the new dimensions each axis splits into, in order
        group = []
        while new and (not group or int(np.prod(group)) < n):
            group.append(new.pop(0))
        if int(np.prod(group)) != n:
            raise ValueError(f"a quantized matrix of shape {w.shape} cannot be reshaped to {tuple(shape)}: only "
                             "splitting its axes keeps each scale's tile")
        groups.append(group)

    def split(a):  # a scale (or zero point): each tiled axis narrowed to divide its group's last dimension
        out = []
        for axis, (n, group) in enumerate(zip(w.shape, groups)):
            tile = n // a.shape[axis]
            fine = int(np.gcd(tile, group[-1]))
            a = jnp.repeat(a, tile // fine, axis=axis) if fine < tile else a
            out += [*group[:-1], group[-1] // fine]
        return a.reshape(out)

    return QArray(w.qvalue.reshape(shape), split(w.scale), None if w.zero_point is None else split(w.zero_point),
                  w.qtype)


def stored_bytes(tree) -> int:
    """The bytes a parameter tree's arrays occupy, a sub-byte dtype's values (int4, NF4's uint4,
    e2m1) at their bits (`.nbytes` counts them a byte each, though XLA packs them two a byte)."""
    def bits(dtype):
        dtype = jnp.dtype(dtype)
        return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits
    return sum(a.size * bits(a.dtype) // 8 for a in jax.tree.leaves(tree))


def format_of(w: QArray) -> str:
    """The format of a quantized matrix, by its stored dtype (`FORMATS` or `SHIPPED`)."""
    if w.qtype in ("nf4", "mxfp4"):  # (uint4 codes: a code book's indices, e2m1's bits)
        return w.qtype
    return {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.int4): "int4", jnp.dtype(jnp.uint4): "int4",
            jnp.dtype(jnp.float8_e4m3fn): "fp8"}[jnp.dtype(w.qtype)]


def check_group(shape: tuple[int, ...], inputs: tuple[int, ...], how: Quantization) -> None:
    """A ValueError unless `how`'s group tiles the inputs of a matrix of `shape`: it divides their
    product, and the last input axis and the group divide one another (int8 has no group)."""
    if how.format == "int8":
        return
    n, last = int(np.prod([shape[i] for i in inputs])), shape[inputs[-1]]
    if n % how.group or (last % how.group and how.group % last):
        fits = tuple(g for g in GROUPS if n % g == 0 and (last % g == 0 or g % last == 0))
        raise ValueError(f"group_size: {how.group} does not divide the matrix's inputs {[shape[i] for i in inputs]} "
                         f"(shape {tuple(shape)}); " + (f"pick one of {fits}" if fits else "quantize it to int8"))


def _grouped(w: jax.Array, inputs: tuple[int, ...], group: int) -> tuple[jax.Array, tuple[int, ...], tuple]:
    """`w` with its input axes (contiguous) read as one, split into `[n / group, group]`; the axis
    the groups' statistics reduce over; and the scale's shape: the input axes tiled, from the last,
    by `group` values (o's `[H, D, d]` with D = 16 in groups of 32: a scale per two heads' channels)."""
    first, n = inputs[0], int(np.prod([w.shape[i] for i in inputs]))
    scale_shape, left = list(w.shape), group  # the tiles, taken from the last input axis back
    for i in reversed(inputs):
        tile = min(left, w.shape[i])
        scale_shape[i] //= tile
        left //= tile
    split = w.reshape(*w.shape[:first], n // group, group, *w.shape[inputs[-1] + 1:])
    return split, (first + 1,), tuple(scale_shape)


def _safe(scale: jax.Array) -> jax.Array:
    """A scale of 1 where a channel or group is all zeros (its values are then 0 however scaled)."""
    return jnp.where(scale > 0, scale, 1)


def quantize(w: jax.Array, how: Quantization, inputs: tuple[int, ...], dtype=jnp.float32) -> QArray:
    """`w` quantized as `how` says, over its input axes `inputs` (ascending; the last one grouped).

    Args:
      w: the float matrix (any float dtype; its statistics are taken in float32).
      how: the format and its options.
      inputs: the axes of `w` that a product sums over (`[d, H, D]`'s `(0,)`, `[H, D, d]`'s `(0, 1)`);
        every other axis (outputs, experts, layers) keeps a scale per index.
      dtype: the scales' (and an affine zero point's) dtype.

    Returns:
      A `Quantized` of `w`'s shape (stored with `inputs` last).

    Raises:
      ValueError: `how`'s group does not tile the inputs (`check_group`).
    """
    check_group(w.shape, inputs, how)
    return stored(_quantize(w, how, tuple(inputs), dtype), tuple(inputs))


@functools.partial(jax.jit, static_argnames=("how", "inputs", "dtype"))
def _quantize(w: jax.Array, how: Quantization, inputs: tuple[int, ...], dtype) -> QArray:
    w = w.astype(jnp.float32)
    if how.format == "int8":  # per output channel: the max over every input axis
        scale = _safe(jnp.max(jnp.abs(w), axis=inputs, keepdims=True) / 127)
        return QArray(jnp.round(w / scale).astype(jnp.int8), scale.astype(dtype))
    groups, over, shape = _grouped(w, inputs, how.group)

    def squeezed(a):  # [.., n / group, 1, ..] -> the scale's shape
        return a.reshape(shape)

    if how.format == "nf4":
        scale = _safe(jnp.max(jnp.abs(groups), axis=over, keepdims=True))
        # The code nearest to v is the number of midpoints between codes that lie below v: fifteen
        # comparisons summed in one pass (no [values, 16] distances held).
        v = groups / scale
        q = sum((v > float(m)).astype(jnp.uint8) for m in (NF4[1:] + NF4[:-1]) / 2)
        return QArray(q.reshape(w.shape).astype(jnp.uint4), squeezed(scale).astype(dtype), qtype="nf4")
    if how.affine:
        low = jnp.minimum(jnp.min(groups, axis=over, keepdims=True), 0)
        high = jnp.maximum(jnp.max(groups, axis=over, keepdims=True), 0)
        scale = _safe((high - low) / 15)
        zero = jnp.round(-low / scale)  # in [0, 15]: the level that stands for 0
        q = jnp.clip(jnp.round(groups / scale) + zero, 0, 15)
        return QArray(q.reshape(w.shape).astype(jnp.uint4), squeezed(scale).astype(dtype),
                      squeezed(zero).astype(jnp.uint4))
    scale = _safe(jnp.max(jnp.abs(groups), axis=over, keepdims=True) / 7)
    q = jnp.clip(jnp.round(groups / scale), -7, 7)
    return QArray(q.reshape(w.shape).astype(jnp.int4), squeezed(scale).astype(dtype))


def dequantize(w: QArray, dtype=None) -> jax.Array:
    """The float matrix `w` stands for, `(qvalue - zero_point) * scale`, in `dtype` (None: the
    scale's), in the model's layout (a `Quantized`'s `shape`); computed in float32 at least,
    rounded once."""
    return dequantize_stored(w.logical() if isinstance(w, Quantized) else w, dtype)


def dequantize_stored(w: QArray, dtype=None) -> jax.Array:
    """`dequantize` in `w`'s stored layout (`qvalue.shape`): what a product reads."""
    wide = jnp.promote_types(w.scale.dtype, jnp.float32)
    if w.qtype == "mxfp4":  # its codes decoded, then each value times its block's power of two
        values = e2m1(w.qvalue).astype(wide)
        return (values * full_scale(w, jnp).astype(wide)).astype(w.scale.dtype if dtype is None else dtype)
    return qwix_dequantize(w.astype(wide)).astype(w.scale.dtype if dtype is None else dtype)


def e2m1(codes: jax.Array) -> jax.Array:
    """float4 e2m1's values (float32) from their 4-bit codes `s e e m`: `(-1)^s 2^(e-1) (1 + m/2)`,
    or `(-1)^s m/2` where `e = 0` (subnormal): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Built as
    float32's bits (sign, exponent `e - 1 + 127`, the mantissa's first bit `m`), elementwise integer
    work that XLA vectorizes, where a table lookup would gather."""
    c = codes.astype(jnp.uint32)
    sign, e, m = c >> 3, (c >> 1) & 3, c & 1
    exponent = jnp.where(e > 0, e + 126, m * 126)  # a subnormal 0.5 (m = 1) is 2^-1; 0 is all zeros
    mantissa = jnp.where(e > 0, m << 22, 0)
    return jax.lax.bitcast_convert_type((sign << 31) | (exponent << 23) | mantissa, jnp.float32)


def from_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=jnp.float32) -> QArray:
    """An MXFP4 matrix as gpt-oss ships it, `[..., out, in]`, as a `QArray` `[..., in, out]`: the
    layout of the tensor a dequantized checkpoint holds under its name (`gate_up_proj` `[E, d, 2F]`).

    Args:
      blocks: uint8 `[..., out, in / 32, 16]`: each byte two e2m1 values, the low nibble first.
      scales: uint8 `[..., out, in / 32]`: each block of 32 inputs' exponent (e8m0), `2 ** (s - 127)`.
      dtype: the scales' dtype (a power of two, exact in float32 and bfloat16).

    Raises:
      ValueError: the shapes do not agree, or a scale is 255 (e8m0's NaN).
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} must be the scales' {scales.shape} and 16 bytes")
    if np.any(scales == 255):
        raise ValueError("MXFP4 scales: 255 (e8m0's NaN) is not a scale")
    exponents = scales.astype(np.int32) - 127
    scale = np.ldexp(np.ones((), np.float32), exponents).astype(dtype)  # [..., out, in / 32]
    return QArray(_mxfp4_codes(blocks), jnp.asarray(np.swapaxes(scale, -1, -2)), qtype="mxfp4")


@jax.jit
def _mxfp4_codes(blocks: jax.Array) -> jax.Array:
    """uint8 `[..., out, in / 32, 16]` (two codes a byte, the low nibble first) -> uint4 `[..., in, out]`,
    in one program: the bytes once in, the codes once out (a 20b checkpoint's expert tensor unpacked in
    numpy held four times its bytes in flight)."""
    nibbles = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., out, in / 32, 16, 2]: low first
    return jnp.swapaxes(nibbles.reshape(*blocks.shape[:-2], -1).astype(jnp.uint4), -1, -2)


def from_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype=jnp.float32) -> QArray:
    """A block-scaled FP8 matrix as DeepSeek-V3 ships it, `[out, in]`, as a `QArray` of that layout.

    Args:
      weight: float8 e4m3 `[out, in]`.
      scale_inv: float `[ceil(out / bo), ceil(in / bi)]`: what each block's values are multiplied by.
      block: `(bo, bi)`, `quantization_config.weight_block_size` (128, 128).
      dtype: the scales' dtype.

    The scale is kept per output channel (each row its block's) and per tile of `gcd(in, bi)`
    inputs, so that a matrix whose last block is partial, or which a layer splits into heads, keeps
    a scale that tiles it evenly.

    Raises:
      ValueError: the shapes do not agree.
    """
    weight, scale_inv = np.asarray(weight), np.asarray(scale_inv, np.float32)
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    (n_out, n_in), (bo, bi) = weight.shape, block
    want = (-(-n_out // bo), -(-n_in // bi))
    if scale_inv.shape != want:
        raise ValueError(f"FP8 weight_scale_inv must be {want} for a {weight.shape} weight in {block} blocks, "
                         f"got {scale_inv.shape}")
    tile = np.gcd(n_in, bi)
    scale = np.repeat(np.repeat(scale_inv, bo, axis=0)[:n_out], bi // tile, axis=1)[:, :n_in // tile]
    return QArray(jnp.asarray(weight), jnp.asarray(scale.astype(dtype)))


def full_scale(w: QArray, xp=np) -> np.ndarray:
    """Each value's scale: `w.scale` repeated over its tile, of `w.qvalue.shape`, as an array of `xp`
    (numpy, or jax.numpy inside a program)."""
    scale = xp.asarray(w.scale)
    for axis, (n, tiles) in enumerate(zip(w.qvalue.shape, w.scale.shape)):
        scale = xp.repeat(scale, n // tiles, axis=axis) if n > tiles else scale
    return scale


def to_mxfp4(w: QArray) -> tuple[np.ndarray, np.ndarray]:
    """`from_mxfp4`'s inverse: an MXFP4 matrix `[..., in, out]` as gpt-oss ships it, `(blocks, scales)`:
    uint8 `[..., out, in / 32, 16]` (two e2m1 values a byte, the low nibble first) and uint8
    `[..., out, in / 32]` (`s` for a scale of `2 ** (s - 127)`). Bit for bit the tensors `w` was read from.

    Raises:
      ValueError: `w` is not MXFP4, or its scales are not one power of two within e8m0's range per 32
        inputs (its values would not be written exactly).
    """
    if format_of(w) != "mxfp4":
        raise ValueError(f"to_mxfp4 writes an MXFP4 matrix, got {format_of(w)}")
    *lead, n_in, n_out = w.shape
    scale = full_scale(w)
    per_block = scale.reshape(*lead, n_in // 32, 32, n_out) if n_in % 32 == 0 else None  # (a view)
    if per_block is None or np.any(per_block != per_block[..., :1, :]):
        raise ValueError(f"an MXFP4 matrix of shape {w.shape} must hold one scale per 32 inputs")
    mantissa, exponent = np.frexp(np.swapaxes(per_block[..., 0, :], -1, -2).astype(np.float32))  # [..., out, in / 32]
    biased = exponent - 1 + 127  # (a power of two is 0.5 * 2 ** exponent)
    if np.any(mantissa != 0.5) or np.any((biased < 0) | (biased > 254)):
        raise ValueError("MXFP4 scales must be powers of two from 2 ** -127 to 2 ** 127 (e8m0's)")
    codes = np.swapaxes(np.asarray(w.qvalue), -1, -2).astype(np.uint8).reshape(*lead, n_out, n_in // 32, 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), biased.astype(np.uint8)


def to_fp8(w: QArray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`from_fp8`'s inverse: a block-scaled FP8 matrix `[out, in]` as DeepSeek-V3 ships it,
    `(weight, scale_inv)`: float8 e4m3 `[out, in]` and float32 `[ceil(out / bo), ceil(in / bi)]`.
    Bit for bit the tensors `w` was read from (its scales in float32; in bfloat16 they are rounded).

    Raises:
      ValueError: `w` is not FP8, or its scale is not one per `block` (its values would not be
        written exactly).
    """
    if format_of(w) != "fp8":
        raise ValueError(f"to_fp8 writes an FP8 matrix, got {format_of(w)}")
    (n_out, n_in), (bo, bi) = w.shape, block
    scale = full_scale(w).astype(np.float32, copy=False)
    scale_inv = scale[::bo, ::bi]  # each block's first value's
    if not np.array_equal(np.repeat(np.repeat(scale_inv, bo, axis=0)[:n_out], bi, axis=1)[:, :n_in], scale):
        raise ValueError(f"an FP8 matrix of shape {w.shape} must hold one scale per {bo} x {bi} block")
    return np.asarray(w.qvalue), scale_inv
