"""LoRA as a function of the parameter tree: `W + (alpha / r) * A @ B` on chosen matrices.

The model's modules are untouched: `merge(params, adapters, lora)` returns the tree the
`Decoder` runs, so a fine-tune differentiates `merge` with respect to the adapters alone and
the base stays as it was loaded. A matrix `W` of shape `[in..., out...]` (q's `[d, H, D]`, o's
`[H, D, d]`) is read as `[n_in, n_out]`; its adapter is `a` `[n_in, r]` and `b` `[r, n_out]`,
peft's `lora_A.weight` `[r, n_in]` and `lora_B.weight` `[n_out, r]` transposed. As in peft,
`a` starts uniform in `±1/sqrt(n_in)` (kaiming-uniform with a = sqrt(5)) and `b` at zero, so
a new adapter changes nothing. (Dropout on the adapter's input, which needs the unmerged
path, is not here yet: merging gives peft's forward with `lora_dropout=0`.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import DecoderConfig
from jaxformer.families import family_of
from jaxformer.files import write_atomically, write_text_atomically
from jaxformer.validation import as_float, as_int

# peft's target names (transformers' module names) and the parameters they are in a block.
TARGETS = {"q_proj": ("attn", "wq"), "k_proj": ("attn", "wk"), "v_proj": ("attn", "wv"), "o_proj": ("attn", "wo"),
           "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"), "down_proj": ("mlp", "w_down")}
INPUT_AXES = {"wo": 2}  # o's input is its heads and their channels; every other target's is its first axis
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which matrices get an adapter, of what rank, scaled by `alpha / rank`.

    Attributes:
      rank: r, the adapters' inner size, >= 1.
      alpha: the scale's numerator (peft's `lora_alpha`), > 0.
      targets: peft's names of the matrices (`TARGETS`' keys), in every block.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        as_int(self.rank, "rank", minimum=1)
        as_float(self.alpha, "alpha", above=0)
        unknown = [t for t in self.targets if t not in TARGETS]
        if not self.targets or unknown or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets must be distinct names among {', '.join(TARGETS)} (got {self.targets!r})")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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


def _peft_keys(config: DecoderConfig, lora: LoraConfig) -> dict:
    """`(block, part, name) -> peft's key stem` (`base_model.model.model.layers.0.self_attn.q_proj`)."""
    wanted = {TARGETS[t] for t in lora.targets}
    stems = {}
    for tensor in family_of(config).tensors(config):
        if len(tensor.path) == 3 and tuple(tensor.path[1:]) in wanted:
            if tensor.rows is not None:
                raise ValueError(f"{tensor.hf_key} is a block of a fused tensor: its adapters do not map to peft's")
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
                      "target_modules": sorted(lora.targets), "lora_dropout": 0.0, "bias": "none",
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
        lora = LoraConfig(rank=given.get("r"), alpha=given.get("lora_alpha"), targets=targets)
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
