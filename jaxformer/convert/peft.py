"""peft's LoRA adapter folders: `adapter_config.json` and `adapter_model.safetensors`, read
(`load_peft`) and written (`save_peft`) as peft reads and writes them, and the targets
(`q_proj`, ..., Phi-3's fused `qkv_proj`) each checkpoint family's format has.

The adapters themselves, and their math, are `jaxformer.lora`'s: `a` `[r, n_in]` is peft's
`lora_A.weight` as it is, `b` `[r, n_out]` its `lora_B.weight` transposed.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from jaxformer.config import LORA_TARGETS, DecoderConfig, LoraConfig
from jaxformer.convert.safetensors_file import SafetensorsFile
from jaxformer.families import family_of
from jaxformer.files import read_json_object, write_atomically, write_text_atomically
from jaxformer.lora import PARTS, adapter_in_out, adapter_matrices
from jaxformer.validation import as_float, as_int, refuse

ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

__all__ = ["adapter_sizes", "all_targets", "check_targets", "load_peft", "save_peft"]


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
            members = [tensors[(f"block_{i}", PARTS[adapter], m)] for m in adapter_matrices(adapter)]
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
    return {(block, part, name): adapter_in_out(name, [shapes[(block, part, m)] for m in adapter_matrices(name)])
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
