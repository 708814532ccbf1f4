"""LoRA: a frozen matrix `W` learns a low-rank change, `W + (alpha / r) * A @ B`.

A matrix `W` of shape `[in..., out...]` (q's `[d, H, D]`, o's `[H, D, d]`) is read as `[n_in,
n_out]`; its adapter is `a` `[n_in, r]` and `b` `[r, n_out]`, peft's `lora_A.weight` `[r,
n_in]` and `lora_B.weight` `[n_out, r]` transposed. As in peft, `a` starts uniform in
`±1/sqrt(n_in)` (kaiming-uniform with a = sqrt(5)) and `b` at zero, so a new adapter changes
nothing. The adapters are a tree shaped like the blocks' parameters, `{block: {part: {name:
{"a", "b"}}}}`, and take part in two ways:

- unmerged, in training: a model whose `DecoderConfig.lora` is set reads them as the `lora`
  variable collection, `apply({"params": base, "lora": adapters}, tokens, rngs={"dropout":
  key})`, and each adapted product becomes `x W + scale * dropout(x) a b` (`project`), as
  peft computes it. Only the adapters are differentiated: the base is read, never updated,
  and no gradient the size of `W` is formed;
- merged, to export or evaluate: `merge(params, adapters, lora)` is the parameter tree with
  each `W` replaced by `W + scale * a b`, which the plain model runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import flax.linen as nn

from jaxformer.config import LORA_TARGETS, DecoderConfig, LoraConfig
from jaxformer.families import family_of
from jaxformer.files import write_atomically, write_text_atomically

# peft's target names (transformers' module names) and the parameters they are in a block.
PARTS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp"}
TARGETS = {target: (PARTS[name], name) for target, name in LORA_TARGETS.items()}
INPUT_AXES = {"wo": 2}  # o's input is its heads and their channels; every other target's is its first axis
LORA_COLLECTION = "lora"  # the variable collection an adapted model reads its adapters from
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

__all__ = ["LORA_COLLECTION", "LoraConfig", "check_targets", "init_lora", "load_peft", "merge", "project", "save_peft"]


def project(module: nn.Module, name: str, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(equation, x, w)`: the product of a block's matrix `name`, and where the
    module's `config.lora` adapts it, plus `scale * dropout(x) a b` (peft's forward, unmerged).

    The equation's letters shared by `x` and `w` are the matrix's input axes, which come
    first in `w` (`"btd,dhk->bthk"`: input `d`, output `hk`); `a` and `b` are read through
    them as `[in..., r]` and `[r, out...]`. Dropout applies where the call has a `dropout`
    rng (`apply(..., rngs={"dropout": key})`), each matrix drawing its own mask as peft's
    modules do.

    Args:
      module: the calling module (`GQASelfAttention`, `SwiGLU`), with its `config`.
      name: the parameter's name in the block (`wq`, `w_down`, ...).
      equation: the product's einsum, `x`'s letters then `w`'s.
      x: the input, in the compute dtype.
      w: the matrix, in the compute dtype.

    Returns:
      The product, in `x`'s dtype.

    Raises:
      ValueError: `config.lora` adapts `name` but the call has no adapter for it.
    """
    y = jnp.einsum(equation, x, w)
    lora = module.config.lora
    if lora is None or name not in lora.param_names:
        return y  # the model's plain product: nothing else is traced
    if not module.has_variable(LORA_COLLECTION, name):
        if module.is_initializing():
            return y  # `init` makes the base's parameters; the adapters come from `init_lora`
        raise ValueError(f"config.lora adapts {name}, but apply() was given no {LORA_COLLECTION!r} "
                         f"variables for it: pass {{'params': ..., {LORA_COLLECTION!r}: init_lora(...)}}")
    adapter = module.get_variable(LORA_COLLECTION, name)
    inputs, out_spec = equation.split("->")
    x_spec, w_spec = inputs.split(",")
    n_in = sum(axis in x_spec for axis in w_spec)
    in_spec, w_out_spec = w_spec[:n_in], w_spec[n_in:]  # w's input axes come first
    rows = "".join(axis for axis in x_spec if axis not in w_spec)  # batch and positions
    a = adapter["a"].reshape(*w.shape[:n_in], lora.rank).astype(x.dtype)  # [in..., r]
    b = adapter["b"].reshape(lora.rank, *w.shape[n_in:]).astype(x.dtype)  # [r, out...]
    if lora.dropout > 0 and module.has_rng("dropout"):
        # Inverted dropout, as torch's: kept inputs scaled by 1 / (1 - p), so the mean is unchanged.
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1 - lora.dropout), 0).astype(x.dtype)
    low = jnp.einsum(f"{x_spec},{in_spec}r->{rows}r", x, a)  # [rows..., r]; no equation here uses the letter r
    return y + lora.scale * jnp.einsum(f"{rows}r,r{w_out_spec}->{out_spec}", low, b)


def _matrices(params, lora: LoraConfig):
    """`(block, part, name, W)` for each target matrix of a per-layer parameter tree."""
    if "blocks" in params:
        raise ValueError("LoRA takes the per-layer parameter tree: unstack a scanned one first "
                         "(jaxformer.convert.unstack_layers)")
    blocks = sorted((k for k in params if k.startswith("block_")), key=lambda k: int(k.split("_")[1]))
    for block in blocks:
        for target in lora.targets:
            part, name = TARGETS[target]
            yield block, part, name, params[block][part][name]


def _in_out(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    n_in = INPUT_AXES.get(name, 1)
    return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def init_lora(params, lora: LoraConfig, key: jax.Array) -> dict:
    """New adapters for `params`: `{block: {part: {name: {"a": [n_in, r], "b": [r, n_out]}}}}`,
    `b` zero (float32, whatever the base's dtype)."""
    adapters: dict = {}
    matrices = list(_matrices(params, lora))
    for key_i, (block, part, name, w) in zip(jax.random.split(key, len(matrices)), matrices):
        n_in, n_out = _in_out(name, w.shape)
        bound = 1.0 / math.sqrt(n_in)
        adapters.setdefault(block, {}).setdefault(part, {})[name] = {
            "a": jax.random.uniform(key_i, (n_in, lora.rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((lora.rank, n_out), jnp.float32)}
    return adapters


def merge(params, adapters: dict, lora: LoraConfig):
    """`params` with each adapted matrix replaced by `W + scale * (a @ b)` (in W's shape and
    dtype); every other leaf is the same array. Differentiable in `adapters`."""
    merged = jax.tree.map(lambda x: x, params)  # new dicts, the same leaves
    for block, part, name, w in _matrices(params, lora):
        ab = adapters[block][part][name]
        delta = (ab["a"] @ ab["b"]) * lora.scale  # [n_in, n_out]
        merged[block][part][name] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
    return merged


def check_targets(config: DecoderConfig, lora: LoraConfig) -> None:
    """Raises ValueError unless each of `lora.targets` is a matrix of its own in `config`'s
    checkpoint format (peft adapts Phi-3's fused `qkv_proj` and `gate_up_proj` whole, which
    these adapters, one a matrix, do not map to)."""
    _peft_keys(config, lora)


def _peft_keys(config: DecoderConfig, lora: LoraConfig) -> dict:
    """`(block, part, name) -> peft's key stem` (`base_model.model.model.layers.0.self_attn.q_proj`)."""
    wanted = {TARGETS[t] for t in lora.targets}
    stems = {}
    for tensor in family_of(config).tensors(config):
        if len(tensor.path) == 3 and tuple(tensor.path[1:]) in wanted:
            if tensor.rows is not None:
                raise ValueError(f"{tensor.hf_key} is a block of a fused tensor ({config.hf_model_type}): its "
                                 "adapters do not map to peft's; adapt the matrices of their own (o_proj, down_proj)")
            stems[tensor.path] = PEFT_PREFIX + tensor.hf_key.removesuffix(".weight")
    return stems


def save_peft(config: DecoderConfig, adapters: dict, lora: LoraConfig, path: str, *,
              base_model: str | None = None) -> None:
    """Writes `adapter_config.json` and `adapter_model.safetensors` as peft writes them, so that
    `peft.PeftModel.from_pretrained(base, path)` loads the adapters (each file atomically)."""
    from safetensors.numpy import save

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for (block, part, name), stem in _peft_keys(config, lora).items():
        ab = adapters[block][part][name]
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ab["a"], np.float32).T)  # [r, n_in]
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ab["b"], np.float32).T)  # [n_out, r]
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                      "target_modules": sorted(lora.targets), "lora_dropout": lora.dropout, "bias": "none",
                      "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": base_model,
                      "inference_mode": True}
    data = save(tensors, metadata={"format": "pt"})
    write_atomically(os.path.join(path, ADAPTER_WEIGHTS_FILE), lambda tmp: tmp.write_bytes(data))
    write_text_atomically(os.path.join(path, ADAPTER_CONFIG_FILE), json.dumps(adapter_config, indent=2) + "\n")


def load_peft(config: DecoderConfig, path: str) -> tuple[dict, LoraConfig]:
    """The adapters of a peft folder (as `save_peft` or peft writes them) and their `LoraConfig`.

    Raises:
      ValueError: naming the file, for a kind of adapter this does not read (not LoRA, rsLoRA,
        per-module ranks, biases) or a tensor missing or of the wrong shape.
    """
    from safetensors.numpy import load_file

    file = os.path.join(path, ADAPTER_CONFIG_FILE)
    with open(file) as f:
        given = json.load(f)
    for key, plain in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False), ("fan_in_fan_out", False),
                       ("rank_pattern", {}), ("alpha_pattern", {})):
        if given.get(key, plain) not in (plain, None):
            raise ValueError(f"{file}: {key} {given[key]!r} is not read here (only {plain!r})")
    targets = given.get("target_modules")
    targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
    try:
        lora = LoraConfig(rank=given.get("r"), alpha=given.get("lora_alpha"), targets=targets,
                          dropout=given.get("lora_dropout") or 0.0)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS_FILE))
    adapters: dict = {}
    shapes = {t.path: t.shape for t in family_of(config).tensors(config)}
    for (block, part, name), stem in _peft_keys(config, lora).items():
        n_in, n_out = _in_out(name, shapes[(block, part, name)])
        pair = {}
        for letter, want in (("a", (lora.rank, n_in)), ("b", (n_out, lora.rank))):
            key = f"{stem}.lora_{letter.upper()}.weight"
            if key not in tensors:
                raise ValueError(f"{path}/{ADAPTER_WEIGHTS_FILE} has no {key}")
            if tensors[key].shape != want:
                raise ValueError(f"{path}/{ADAPTER_WEIGHTS_FILE}: {key} is {tensors[key].shape}, not {want}")
            pair[letter] = jnp.asarray(tensors[key].astype(np.float32).T)
        adapters.setdefault(block, {}).setdefault(part, {})[name] = pair
    return adapters, lora
