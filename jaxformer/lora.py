"""LoRA: a frozen matrix `W` learns a low-rank change, `W + (alpha / r) * A @ B`.

A matrix `W` of shape `[in..., out...]` (q's `[d, H, D]`, o's `[H, D, d]`) is read as `[n_in,
n_out]`; its adapter is `a` `[r, n_in]` (peft's `lora_A.weight` as it is) and `b` `[r, n_out]`
(peft's `lora_B.weight` `[n_out, r]` transposed), and the change is `a^T b`. Both keep `r`
first so that their gradients, `dlow^T x` and `low^T dy`, contract the positions of
`[positions, r]` operands: no `[positions, width]` activation is transposed for them (XLA's
CPU backend copies every transposed operand, and the FFN's are 2.75 d_model wide). As in peft, `a` starts uniform in
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import FUSED_ADAPTERS, LORA_TARGETS, DecoderConfig, LoraConfig
from jaxformer.convert.safetensors_file import SafetensorsFile
from jaxformer.families import family_of
from jaxformer.files import read_json_object, write_atomically, write_text_atomically
from jaxformer.products import product
from jaxformer.validation import as_float, as_int, refuse

PARTS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "wqkv": "attn",
         "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp", "w_gate_up": "mlp"}  # adapter -> its module in a block
INPUT_AXES = {"wo": 2}  # o's input is its heads and their channels; every other matrix's is its first axis
LORA_COLLECTION = "lora"  # the variable collection an adapted model reads its adapters from
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

__all__ = ["LORA_COLLECTION", "Adapted", "LoraConfig", "adapter_sizes", "all_targets", "check_targets",
           "init_lora", "load_peft", "merge", "project", "save_peft"]


def _members(adapter: str) -> tuple[str, ...]:
    """The matrices an adapter changes: itself, or a fused adapter's, in their column order."""
    return FUSED_ADAPTERS.get(adapter, (adapter,))


def project(module: nn.Module, x: jax.Array, *products: tuple[str, str, jax.Array]) -> list[jax.Array]:
    """`einsum(equation, x, w)` for each `(name, equation, w)` of a block's matrices reading
    `x`, and where the module's `config.lora` adapts one, plus `scale * dropout(x) a b`
    (peft's forward, unmerged).

    The equation's letters shared by `x` and `w` are the matrix's input axes, which come
    first in `w` (`"btd,dhk->bthk"`: input `d`, output `hk`); `a` and `b` are read through
    them as `[in..., r]` and `[r, out...]`. A fused adapter (Phi-3's `wqkv`) has one `a`,
    and its `b`'s columns are its matrices' one after another. Dropout applies where the
    call has a `dropout` rng (`apply(..., rngs={"dropout": key})`), each adapter drawing its
    own mask, as peft's modules do.

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
    for adapter in lora.adapters:
        members = [index[m] for m in _members(adapter) if m in index]
        if not members:
            continue
        if not module.has_variable(LORA_COLLECTION, adapter):
            if module.is_initializing():
                continue  # `init` makes the base's parameters; the adapters come from `init_lora`
            raise ValueError(f"config.lora adapts {adapter}, but apply() was given no {LORA_COLLECTION!r} "
                             f"variables for it: pass {{'params': ..., {LORA_COLLECTION!r}: init_lora(...)}}")
        ab = module.get_variable(LORA_COLLECTION, adapter)
        _, equation, w = products[members[0]]
        x_spec, w_spec = equation.split("->")[0].split(",")
        n_in = sum(axis in x_spec for axis in w_spec)  # w's input axes come first
        rows = "".join(axis for axis in x_spec if axis not in w_spec)  # batch and positions
        x_in = x
        if lora.dropout > 0 and module.has_rng("dropout"):
            # Inverted dropout, as torch's: kept inputs scaled by 1 / (1 - p), so the mean is unchanged.
            keep = jax.random.bernoulli(module.make_rng("dropout"), 1 - lora.dropout, x.shape)
            x_in = jnp.where(keep, x / (1 - lora.dropout), 0).astype(x.dtype)
        a = ab["a"].reshape(lora.rank, *w.shape[:n_in]).astype(x.dtype)  # [r, in...]
        low = jnp.einsum(f"{x_spec},r{w_spec[:n_in]}->{rows}r", x_in, a)  # [rows..., r]; r: a letter no equation uses
        start = 0
        for i in members:  # each matrix's columns of b, in turn
            _, equation, w = products[i]
            (_, w_spec), out_spec = equation.split("->")[0].split(","), equation.split("->")[1]
            width = math.prod(w.shape[n_in:])
            b = ab["b"][:, start:start + width].reshape(lora.rank, *w.shape[n_in:]).astype(x.dtype)  # [r, out...]
            outs[i] = outs[i] + lora.scale * jnp.einsum(f"{rows}r,r{w_spec[n_in:]}->{out_spec}", low, b)
            start += width
    return outs


def _adapted(params, lora: LoraConfig):
    """`(block, part, adapter, [W...])` for each adapter of a per-layer parameter tree, with
    the matrices it changes (one; a fused adapter's several)."""
    if "blocks" in params:
        raise ValueError("LoRA takes the per-layer parameter tree: unstack a scanned one first "
                         "(jaxformer.convert.unstack_layers)")
    blocks = sorted((k for k in params if k.startswith("block_")), key=lambda k: int(k.split("_")[1]))
    for block in blocks:
        for adapter in lora.adapters:
            part = PARTS[adapter]
            yield block, part, adapter, [params[block][part][m] for m in _members(adapter)]


def _in_out(adapter: str, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """An adapter's `(n_in, n_out)`: its matrices' input size, and their output sizes summed."""
    n_in = INPUT_AXES.get(adapter, 1)
    return math.prod(shapes[0][:n_in]), sum(math.prod(shape[n_in:]) for shape in shapes)


def init_lora(params, lora: LoraConfig, key: jax.Array) -> dict:
    """New adapters for `params`: `{block: {part: {adapter: {"a": [r, n_in], "b": [r, n_out]}}}}`,
    `b` zero (float32, whatever the base's dtype)."""
    adapters: dict = {}
    found = list(_adapted(params, lora))
    for key_i, (block, part, adapter, ws) in zip(jax.random.split(key, len(found)), found):
        n_in, n_out = _in_out(adapter, [w.shape for w in ws])
        bound = 1.0 / math.sqrt(n_in)
        adapters.setdefault(block, {}).setdefault(part, {})[adapter] = {
            "a": jax.random.uniform(key_i, (lora.rank, n_in), jnp.float32, -bound, bound),
            "b": jnp.zeros((lora.rank, n_out), jnp.float32)}
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
    `adapters`."""
    merged = jax.tree.map(lambda x: x, params)  # new dicts, the same leaves
    for block, part, adapter, ws in _adapted(params, lora):
        ab = adapters[block][part][adapter]
        delta = (ab["a"].T @ ab["b"]) * lora.scale  # [n_in, n_out]
        start = 0
        for name, w in zip(_members(adapter), ws):
            width = w.size // delta.shape[0]
            merged[block][part][name] = (w.astype(jnp.float32)
                                         + delta[:, start:start + width].reshape(w.shape)).astype(w.dtype)
            start += width
    return merged


def all_targets(config: DecoderConfig) -> tuple[str, ...]:
    """Every target `config`'s checkpoint format has: Llama's seven projections, or Phi-3's
    four (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`)."""
    targets = []
    for target in LORA_TARGETS:
        try:
            _peft_keys(config, LoraConfig(targets=(target,)))
        except ValueError:
            continue
        targets.append(target)
    return tuple(targets)


def check_targets(config: DecoderConfig, lora: LoraConfig) -> None:
    """Raises ValueError unless each of `lora.targets` is a module of `config`'s checkpoint
    format, as peft names it (Phi-3 has `qkv_proj` and `gate_up_proj`, the others `q_proj`,
    ...)."""
    try:
        _peft_keys(config, lora)
    except ValueError as e:
        raise ValueError(f"{e}; its targets: {', '.join(all_targets(config))}") from None


def _peft_keys(config: DecoderConfig, lora: LoraConfig) -> dict:
    """`(block, part, adapter) -> peft's key stem` (`base_model.model.model.layers.0.self_attn.q_proj`):
    the checkpoint tensor that holds the adapter's matrices, all of it."""
    tensors = {t.path: t for t in family_of(config).tensors(config)}
    stems = {}
    for i in range(config.n_layer):
        for target, adapter in zip(lora.targets, lora.adapters):
            members = [tensors[(f"block_{i}", PARTS[adapter], m)] for m in _members(adapter)]
            fused = {t.hf_key for t in members}
            # The adapter is the tensor's: the matrices are all of it (rows, in order) or it alone.
            whole = len(fused) == 1 and (
                (len(members) == 1 and members[0].rows is None)
                or [t.rows for t in members] == [(sum(x.hf_shape[0] for x in members[:k]),
                                                  sum(x.hf_shape[0] for x in members[:k + 1]))
                                                 for k in range(len(members))])
            hf_key = members[0].hf_key
            if not whole or not hf_key.endswith(f".{target}.weight"):
                model_type = config.hf_model_type or "llama"
                raise ValueError(f"{target} is not a module of a {model_type} checkpoint (layer {i}'s "
                                 f"{'/'.join(members[0].path[1:])} is in {hf_key})")
            stems[(f"block_{i}", PARTS[adapter], adapter)] = PEFT_PREFIX + hf_key.removesuffix(".weight")
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
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ab["a"], np.float32))  # [r, n_in]
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ab["b"], np.float32).T)  # [n_out, r]
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                      "target_modules": sorted(lora.targets), "lora_dropout": lora.dropout, "bias": "none",
                      "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": base_model,
                      "inference_mode": True}
    data = save(tensors, metadata={"format": "pt"})
    write_atomically(os.path.join(path, ADAPTER_WEIGHTS_FILE), lambda tmp: tmp.write_bytes(data))
    write_text_atomically(os.path.join(path, ADAPTER_CONFIG_FILE), json.dumps(adapter_config, indent=2) + "\n")


def adapter_sizes(config: DecoderConfig, lora: LoraConfig) -> dict[tuple[str, str, str], tuple[int, int]]:
    """`(block, part, adapter) -> (n_in, n_out)` of every adapter `lora` gives a model of
    `config`, from the config alone: `a` is `[rank, n_in]`, `b` `[rank, n_out]`.

    Raises:
      ValueError: a target that `config`'s checkpoint format lacks (`check_targets`).
    """
    check_targets(config, lora)
    shapes = {t.path: t.shape for t in family_of(config).tensors(config)}
    return {(block, part, name): _in_out(name, [shapes[(block, part, m)] for m in _members(name)])
            for block, part, name in _peft_keys(config, lora)}


def load_peft(config: DecoderConfig, path: str) -> tuple[dict, LoraConfig]:
    """The adapters of a peft folder (as `save_peft` or peft writes them) and their `LoraConfig`,
    every file checked against `config` before any tensor is used: the JSON's types, each
    tensor's name, dtype and shape, and its values (finite).

    Raises:
      FileNotFoundError: naming the file missing.
      ValueError: naming the file: unreadable or malformed, a kind of adapter this does not
        read (not LoRA, rsLoRA, per-module ranks, biases), a tensor missing, unexpected, of
        the wrong dtype or shape, or holding NaN or inf.
    """
    lora = _read_adapter_config(os.path.join(path, ADAPTER_CONFIG_FILE), path)
    file = os.path.join(path, ADAPTER_WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: missing (a peft adapter folder holds it; adapter_model.bin, torch's pickle "
                                "format, is not read: save with safe_serialization=True)")
    try:
        sizes = adapter_sizes(config, lora)
    except ValueError as e:
        raise ValueError(f"{os.path.join(path, ADAPTER_CONFIG_FILE)}: target_modules: {e}") from None
    want = {}  # tensor name -> (adapter's key, "a" or "b", the shape peft stores it in)
    for key, stem in _peft_keys(config, lora).items():
        n_in, n_out = sizes[key]
        want[f"{stem}.lora_A.weight"] = (key, "a", (lora.rank, n_in))
        want[f"{stem}.lora_B.weight"] = (key, "b", (n_out, lora.rank))
    stored = SafetensorsFile(file)
    for names, what in ((sorted(want.keys() - stored.keys), "lacks"), (sorted(stored.keys - want.keys()), "holds")):
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ValueError(f"{file} {what} {names[0]}{more}: not the adapters its adapter_config.json describes for "
                             f"this {config.hf_model_type or 'llama'} checkpoint ({config.n_layer} layers, targets "
                             f"{', '.join(lora.targets)}, r={lora.rank})")
    adapters: dict = {}
    for name, ((block, part, adapter), letter, shape) in want.items():
        if stored.shape(name) != shape:
            raise ValueError(f"{file}: {name} is {stored.shape(name)}, not {shape}")
        value = np.asarray(stored.tensor(name), np.float32)
        if not np.isfinite(value).all():
            raise ValueError(f"{file}: {name} holds NaN or inf: not a usable adapter (a run that diverged, or a "
                             "damaged file)")
        pair = adapters.setdefault(block, {}).setdefault(part, {}).setdefault(adapter, {})
        pair[letter] = jnp.asarray(value if letter == "a" else value.T)  # a [r, n_in], b [r, n_out]
    return adapters, lora


def _read_adapter_config(file: str, path: str) -> LoraConfig:
    """The `LoraConfig` of a peft `adapter_config.json`, its JSON types checked."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG_FILE} there: not a peft adapter folder")
    given = read_json_object(file)
    for key, plain in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False), ("fan_in_fan_out", False),
                       ("rank_pattern", {}), ("alpha_pattern", {})):
        if given.get(key, plain) not in (plain, None):
            raise ValueError(f"{file}: {key} {given[key]!r} is not read here (only {plain!r})")
    targets = given.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        refuse(f"{file}: target_modules", "a module name or a list of them", given.get("target_modules"))
    rank = as_int(given.get("r"), f"{file}: r", minimum=1)
    alpha = as_float(given.get("lora_alpha"), f"{file}: lora_alpha", above=0)
    dropout = as_float(given.get("lora_dropout") or 0.0, f"{file}: lora_dropout", at_least=0, below=1)
    try:
        return LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets), dropout=dropout)
    except ValueError as e:  # (the rest is checked above: only the targets are left)
        raise ValueError(f"{file}: target_modules: {e}") from None
