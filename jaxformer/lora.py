"""LoRA: a frozen matrix `W` learns a low-rank change, `W + (alpha / r) * A @ B`.

A matrix `W` of shape `[in..., out...]` (q's `[d, H, D]`, o's `[H, D, d]`) is read as `[n_in,
n_out]`; its adapter is `a` `[r, n_in]` (peft's `lora_A.weight` as it is) and `b` `[r, n_out]`
(peft's `lora_B.weight` `[n_out, r]` transposed), and the change is `a^T b`. Both keep `r`
first so that their gradients, `dlow^T x` and `low^T dy`, contract the positions of
`[positions, r]` operands: no `[positions, width]` activation is transposed for them (XLA's
CPU backend copies every transposed operand, and the FFN's are 2.75 d_model wide). As in peft, `a` starts uniform in
`±1/sqrt(n_in)` (kaiming-uniform with a = sqrt(5)) and `b` at zero, so a new adapter changes
nothing. The adapters are a tree shaped like the blocks' parameters, `{block: {part: {name:
{"a", "b"}}}}` (a feed-forward of an MLP and experts side by side, Gemma 4's, nests its two as its
parameters do: `{block: {"mlp": {"dense": {"w_gate": ...}, "experts": {"experts_down": ...}}}}`,
`adapter_part`), and take part in two ways:

- unmerged, in training: a model whose `DecoderConfig.lora` is set reads them as the `lora`
  variable collection, `apply({"params": base, "lora": adapters}, tokens, rngs={"dropout":
  key})`, and each adapted product becomes `x W + scale * dropout(x) a b` (`project`), as
  peft computes it. Only the adapters are differentiated: the base is read, never updated,
  and no gradient the size of `W` is formed;
- merged, to export or evaluate: `merge(params, adapters, lora)` is the parameter tree with
  each `W` replaced by `W + scale * a b`, which the plain model runs.

A layer of experts' stacked matrices (`w_gate`, `w_up` `[E, d, F]`, `w_down` `[E, F, d]`) take
adapters as peft gives transformers' fused expert parameters (peft's `LoraConfig(target_parameters
=...)`, its `ParamWrapper`): one low-rank change per expert, `W[e] + scale * a[e]^T b[e]`, `a`
`[E, r, n_in]` and `b` `[E, r, n_out]`; `experts_gate_up` is one adapter over gate and up
(transformers' `gate_up_proj`: one `a[e]`, `b[e]`'s columns the gate's then up's), and
`experts_down` down's. Unmerged, each is two more grouped products in the experts' layer
(`jaxformer.experts.routed`), `(rows a[e]^T) b[e]` for the rows routed to expert e, so its
cost grows with the experts chosen, as the layer's own products do. peft takes no dropout on
them, nor do they.

peft's files (`adapter_config.json`, `adapter_model.safetensors`), its target names and each
family's fused modules are `jaxformer.convert.peft`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.config import EXPERT_ADAPTERS, LINEAR_ADAPTERS, LoraConfig, adapter_matrices
from jaxformer.dropout import drop
from jaxformer.products import precision_for, product
from jaxformer.quantized import QArray, dequantize

PARTS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "wqkv": "attn",
         "wq_a": "attn", "wq_b": "attn", "wkv_a": "attn", "wkv_b": "attn",
         "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp", "w_gate_up": "mlp",
         "experts_gate_up": "mlp", "experts_down": "mlp",
         **{adapter: "attn" for adapter in LINEAR_ADAPTERS}}  # adapter -> its module in a block
INPUT_AXES = {"wo": 2, "linear_o": 2}  # o's input: its heads and their channels; every other's: its first axis
LORA_COLLECTION = "lora"  # the variable collection an adapted model reads its adapters from

__all__ = ["LORA_COLLECTION", "PARTS", "Adapted", "LoraConfig", "adapter_in_out", "adapter_matrices",
           "adapter_part", "adapter_shapes", "experts_adapters", "init_lora", "merge", "module_at", "project",
           "with_adapter"]


def adapter_part(adapter: str, beside: bool = False) -> str:
    """The module of a block that holds `adapter`'s matrices, as a path of names (`attn`, `mlp`): in
    a block whose feed-forward is an MLP and experts side by side (`beside`: Gemma 4's
    `DenseAndExperts`, whose parameters are `mlp/dense/*` and `mlp/experts/*`), the MLP's targets'
    `mlp/dense`, the experts' `mlp/experts`."""
    part = PARTS[adapter]
    if beside and part == "mlp":
        return "mlp/experts" if adapter in EXPERT_ADAPTERS else "mlp/dense"
    return part


def module_at(tree: dict, block: str, part: str, create: bool = False) -> dict:
    """The subtree of `tree` (parameters or adapters) at `block`'s module `part` (`adapter_part`'s
    path); `{}` where it has none, or with `create`, new dicts made on the way."""
    node = tree.get(block, {}) if not create else tree.setdefault(block, {})
    for name in part.split("/"):
        node = node.get(name, {}) if not create else node.setdefault(name, {})
    return node


def project(module: nn.Module, x: jax.Array, *products: tuple[str, str, jax.Array]) -> list[jax.Array]:
    """`einsum(equation, x, w)` for each `(name, equation, w)` of a block's matrices reading
    `x`, and where the module's `config.lora` adapts one, plus `scale * dropout(x) a b`
    (peft's forward, unmerged).

    The equation's letters shared by `x` and `w` are the matrix's input axes, which come
    first in `w` (`"btd,dhk->bthk"`: input `d`, output `hk`); `a` and `b` are read through
    them as `[in..., r]` and `[r, out...]`. A fused adapter (Phi-3's `wqkv`) has one `a`,
    and its `b`'s columns are its matrices' one after another. Dropout applies where the
    call has a `dropout` rng (`apply(..., rngs={"dropout": key})`), each adapter drawing its
    own mask, as peft's modules do. A Gated DeltaNet's calls (a module whose `linear_adapters`
    is True) take its adapters alone (`LINEAR_ADAPTERS`), every other module's none of them: the
    two kinds share the names `wq` and `wo` but not the checkpoint's modules.

    Args:
      module: the calling module (`GQASelfAttention`, `SwiGLU`), with its `config`.
      x: the input, in the compute dtype.
      *products: `(name, equation, w)`: the parameter's name in the block (`wq`, ...), the
        product's einsum (`x`'s letters, then `w`'s), the matrix in the compute dtype. All
        the matrices of a fused adapter are in one call.

    Returns:
      The products, in order, in `x`'s dtype.

    Raises:
      ValueError: `config.lora` adapts one of them but the call has no adapter for it.
    """
    outs = [product(equation, x, w) for _, equation, w in products]
    lora = module.config.lora
    if lora is None:
        return outs  # the model's plain products: nothing else is traced
    index = {name: i for i, (name, _, _) in enumerate(products)}
    linear = getattr(module, "linear_adapters", False)
    for adapter in lora.adapters:
        if adapter in EXPERT_ADAPTERS or (adapter in LINEAR_ADAPTERS) != linear:
            continue  # the experts' layer's own (`experts_adapters`), or another kind of layer's
        members = [index[m] for m in adapter_matrices(adapter) if m in index]
        ab = _variables(module, adapter) if members else None
        if ab is None:
            continue
        _, equation, w = products[members[0]]
        x_spec, w_spec = equation.split("->")[0].split(",")
        n_in = sum(axis in x_spec for axis in w_spec)  # w's input axes come first
        rows = "".join(axis for axis in x_spec if axis not in w_spec)  # batch and positions
        x_in = x
        if lora.dropout > 0 and module.has_rng("dropout"):
            x_in = drop(x, module.make_rng("dropout"), lora.dropout)  # inverted dropout, as torch's
        a = ab["a"].reshape(lora.rank, *w.shape[:n_in]).astype(x.dtype)  # [r, in...]
        low = product(f"{x_spec},r{w_spec[:n_in]}->{rows}r", x_in, a)  # [rows..., r]; r: a letter no equation uses
        start = 0
        for i in members:  # each matrix's columns of b, in turn
            _, equation, w = products[i]
            (_, w_spec), out_spec = equation.split("->")[0].split(","), equation.split("->")[1]
            width = math.prod(w.shape[n_in:])
            b = ab["b"][:, start:start + width].reshape(lora.rank, *w.shape[n_in:]).astype(x.dtype)  # [r, out...]
            outs[i] = outs[i] + lora.scale * product(f"{rows}r,r{w_spec[n_in:]}->{out_spec}", low, b)
            start += width
    return outs


def _variables(module: nn.Module, adapter: str) -> dict | None:
    """The `{"a", "b"}` of `adapter`, which `module.config.lora` adapts; None while `init` runs
    (it makes the base's parameters; the adapters come from `init_lora`).

    Raises:
      ValueError: the call has no such adapter.
    """
    if not module.has_variable(LORA_COLLECTION, adapter):
        if module.is_initializing():
            return None
        raise ValueError(f"config.lora adapts {adapter}, but apply() was given no {LORA_COLLECTION!r} "
                         f"variables for it: pass {{'params': ..., {LORA_COLLECTION!r}: init_lora(...)}}")
    return module.get_variable(LORA_COLLECTION, adapter)


def with_adapter(module: nn.Module, name: str, w: jax.Array) -> jax.Array:
    """`w` (parameter `name` of the module's block, in the compute dtype) with its adapter's change
    added, `W + scale * a^T b` in W's shape and dtype, where `module.config.lora` adapts it; else
    `w`. For a matrix that a product reads other than as `x W` (a latent attention's decoding
    reads W_KVB's two parts into its query and its output): `project`'s adapter, merged, and so
    without the dropout on its input, which only training's `project` draws.

    Raises:
      ValueError: `config.lora` adapts it but the call has no adapter for it.
    """
    lora = module.config.lora
    ab = None if lora is None or name not in lora.adapters else _variables(module, name)
    if ab is None:
        return w
    wide = jnp.promote_types(w.dtype, jnp.float32)  # (summed in float32 at least, rounded once)
    a, b = ab["a"].astype(wide), ab["b"].astype(wide)
    delta = jnp.einsum("ri,ro->io", a, b, precision=precision_for(wide)) * lora.scale  # [n_in, n_out]
    return (w.astype(wide) + delta.reshape(w.shape)).astype(w.dtype)


def experts_adapters(module: nn.Module, dtype) -> dict | None:
    """A layer of experts' adapters as `jaxformer.experts.routed` takes them, `{"gate_up" or
    "down": (a [E, n_in, r], b [E, r, n_out])}` in `dtype`, `b` times the scale; None where
    `module.config.lora` adapts none of the experts' matrices (or while `init` runs: the
    adapters come from `init_lora`).

    Raises:
      ValueError: `config.lora` adapts them but the call has no adapter for one.
    """
    lora = module.config.lora
    if lora is None or not lora.expert_adapters:
        return None
    adapters = {}
    for adapter in lora.expert_adapters:
        ab = _variables(module, adapter)
        if ab is None:
            return None
        a = jnp.swapaxes(ab["a"], 1, 2).astype(dtype)  # [E, n_in, r]: as the experts' matrices, input first
        adapters[adapter.removeprefix("experts_")] = (a, (lora.scale * ab["b"]).astype(dtype))
    return adapters


def _is_stacked(module: dict) -> bool:
    """Whether a feed-forward's parameters are a layer of experts' (its matrices stacked `[E, ...]`)."""
    return "w_gate" in module and module["w_gate"].ndim == 3


def _is_beside(params, block: str) -> bool:
    """Whether `block`'s feed-forward is an MLP and experts side by side (`mlp/dense`, `mlp/experts`)."""
    mlp = params[block].get("mlp", {})
    return "dense" in mlp and "experts" in mlp


def _is_linear(params, block: str) -> bool:
    """Whether `block`'s mixer is a Gated DeltaNet (its parameters hold the decay's `a_log`)."""
    return "a_log" in params[block].get("attn", {})


def _adapted(params, lora: LoraConfig):
    """`(block, part, adapter, [W...])` for each adapter of a per-layer parameter tree, with
    the matrices it changes (one; a fused adapter's several), in the blocks that hold them: the
    experts' adapters in each layer of experts alone (a dense layer among them has none; beside an
    MLP, Gemma 4's, the MLP's `mlp/dense` and the experts' `mlp/experts`, `adapter_part`), a
    Gated DeltaNet's in those layers alone, the others in every other layer with the matrices
    (a latent attention's `wq_a`, where it has one).

    Raises:
      ValueError: a scanned tree, a module's adapter of the MLP on a layer of experts, or an
        adapter that no block holds.
    """
    if "blocks" in params:
        raise ValueError("LoRA takes the per-layer parameter tree: unstack a scanned one first "
                         "(jaxformer.convert.unstack_layers)")
    blocks = sorted((k for k in params if k.startswith("block_")), key=lambda k: int(k.split("_")[1]))
    found = set()
    for block in blocks:
        beside = _is_beside(params, block)
        for target, adapter in zip(lora.targets, lora.adapters):
            part = adapter_part(adapter, beside)
            module = module_at(params, block, part)
            if (adapter in EXPERT_ADAPTERS) != (PARTS[adapter] == "mlp" and _is_stacked(module)):
                if adapter in EXPERT_ADAPTERS:
                    continue
                raise ValueError(f"LoraConfig.targets={lora.targets}: {block}'s MLP is a layer of experts; adapt "
                                 "its matrices with mlp.experts.gate_up_proj and mlp.experts.down_proj")
            mixers_kind = part == "attn" and (adapter in LINEAR_ADAPTERS) != _is_linear(params, block)
            if mixers_kind or not all(m in module for m in adapter_matrices(adapter)):
                continue  # (another kind of mixer's, or a matrix this layer lacks)
            found.add(target)
            yield block, part, adapter, [module[m] for m in adapter_matrices(adapter)]
    for target in lora.targets:
        if target not in found:
            raise ValueError(f"LoraConfig.targets={lora.targets}: no layer of this parameter tree has {target}")


def adapter_in_out(adapter: str, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """An adapter's `(n_in, n_out)`: its matrices' input size, and their output sizes summed
    (an experts' adapter's: each expert's, `shapes` without the experts' axis)."""
    n_in = INPUT_AXES.get(adapter, 1)
    return math.prod(shapes[0][:n_in]), sum(math.prod(shape[n_in:]) for shape in shapes)


def adapter_shapes(adapter: str, shapes: list[tuple[int, ...]], rank: int) -> tuple[tuple, tuple]:
    """The shapes of an adapter's `a` and `b` for matrices of `shapes` (as the parameter tree
    holds them): `[r, n_in]` and `[r, n_out]`, an experts' adapter's `[E, r, n_in]` and
    `[E, r, n_out]`."""
    if adapter not in EXPERT_ADAPTERS:
        n_in, n_out = adapter_in_out(adapter, shapes)
        return (rank, n_in), (rank, n_out)
    n_in, n_out = adapter_in_out(adapter, [shape[1:] for shape in shapes])
    return (shapes[0][0], rank, n_in), (shapes[0][0], rank, n_out)


def init_lora(params, lora: LoraConfig, key: jax.Array) -> dict:
    """New adapters for `params`: `{block: {part: {adapter: {"a": [r, n_in], "b": [r, n_out]}}}}`
    (an experts' adapter: `[E, r, n_in]`, `[E, r, n_out]`), `b` zero (float32, whatever the
    base's dtype)."""
    adapters: dict = {}
    found = list(_adapted(params, lora))
    for key_i, (block, part, adapter, ws) in zip(jax.random.split(key, len(found)), found):
        a_shape, b_shape = adapter_shapes(adapter, [w.shape for w in ws], lora.rank)
        bound = 1.0 / math.sqrt(a_shape[-1])
        module_at(adapters, block, part, create=True)[adapter] = {
            "a": jax.random.uniform(key_i, a_shape, jnp.float32, -bound, bound),
            "b": jnp.zeros(b_shape, jnp.float32)}
    return adapters


@dataclasses.dataclass(frozen=True)
class Adapted:
    """A `Decoder` whose `config.lora` adapts it, as a model the decoding strategies drive
    with its adapters beside the base, unmerged: `generate(Adapted(model), {"base": params,
    "lora": adapters}, prompt)`. A step costs the adapters' products more than the merged
    model's, and no second copy of the adapted matrices is made (`merge` makes one).
    """

    model: "Decoder"  # noqa: F821

    def decoding_spec(self):
        return self.model.decoding_spec()

    def decoder_prompt(self, prompt, bos_id):
        return self.model.decoder_prompt(prompt, bos_id)

    def init_cache(self, batch_size: int, capacity: int, rewind: int = 0):
        return self.model.init_cache(batch_size, capacity, rewind)

    def apply(self, variables: dict, *args, **kwargs):
        """`model.apply` with `variables["params"]` `{"base": ..., "lora": ...}` as its two collections."""
        params = variables["params"]
        return self.model.apply({"params": params["base"], LORA_COLLECTION: params["lora"]}, *args, **kwargs)


def merge(params, adapters: dict, lora: LoraConfig):
    """`params` with each adapted matrix replaced by `W + scale * (a @ b)` (its columns of
    `b`, in W's shape and dtype); every other leaf is the same array. Differentiable in
    `adapters`. A quantized `W` (QLoRA's base) is dequantized first: the merged matrix is
    float, in its scales' dtype."""
    merged = jax.tree.map(lambda x: x, params, is_leaf=lambda x: isinstance(x, QArray))  # new dicts, same leaves
    for block, part, adapter, ws in _adapted(params, lora):
        ab, module = module_at(adapters, block, part)[adapter], module_at(merged, block, part)
        start = 0
        for name, w in zip(adapter_matrices(adapter), ws):
            w = dequantize(w) if isinstance(w, QArray) else w
            if adapter in EXPERT_ADAPTERS:
                module[name] = _merged_experts(w, ab["a"], ab["b"], lora.scale, start)
                start += w.shape[-1]
            else:
                module[name] = _merged(w, ab["a"], ab["b"], lora.scale, start)
                start += w.size // ab["a"].shape[1]
    return merged


# Jitted: one program a matrix, wherever `w` lies; op by op, a `w` split over several
# processes would make each operation a program of its own across them.
@functools.partial(jax.jit, static_argnames="start")
def _merged(w, a, b, scale, start: int):
    """`W + scale * a^T b[:, start:start + width]`, in W's shape and dtype: one matrix of an
    adapter (a fused one's columns from `start`)."""
    width = w.size // a.shape[1]
    delta = (a.T @ b[:, start:start + width]) * scale  # [n_in, width]
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)


@functools.partial(jax.jit, static_argnames="start")
def _merged_experts(w, a, b, scale, start: int):
    """`W[e] + scale * a[e]^T b[e][:, start:start + width]` for each expert e, in W's shape
    and dtype: one stacked matrix `[E, n_in, width]` of an experts' adapter."""
    delta = jnp.einsum("eri,ero->eio", a, b[:, :, start:start + w.shape[-1]]) * scale
    return (w.astype(jnp.float32) + delta).astype(w.dtype)
