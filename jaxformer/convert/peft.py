"""peft's LoRA adapter folders: `adapter_config.json` and `adapter_model.safetensors`, read
(`load_peft`) and written (`save_peft`) as peft reads and writes them, and the targets
(`q_proj`, ..., Phi-3's fused `qkv_proj`) each checkpoint family's format has.

The adapters themselves, and their math, are `jaxformer.lora`'s: `a` `[r, n_in]` is peft's
`lora_A.weight` as it is, `b` `[r, n_out]` its `lora_B.weight` transposed. A fused module's `b`
holds its matrices' columns one after another; where the checkpoint groups their rows
otherwise (Qwen3-Next's `in_proj_qkvz`: each key head's q, k, v and z together), peft's
`lora_B` rows are the checkpoint's, and `_peft_rows` reorders them. A target adapts the layers
whose checkpoint has its module (a hybrid's `q_proj` its attention layers', `in_proj_qkv` its
Gated DeltaNet layers').

The experts' adapters are peft's of transformers 5's fused expert parameters
(`target_parameters`: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, the same in every
family of experts but Gemma 4, whose experts sit beside its MLP, `model.layers.i.experts` beside
`model.layers.i.mlp`: `experts.gate_up_proj`, `experts.down_proj`, which peft matches as a tail of
the parameter's name; its MLP's `gate_proj`, ... are modules as any MLP's), each a `ParamWrapper`
holding all E experts' in one pair of matrices:

    lora_A.weight  [E * r, n_in]    rows e * r + j: expert e's a[e][j]
    lora_B.weight  [n_out, r * E]   columns j * E + e: expert e's b[e][j] (rank first, then expert)

so that `W[e] + scale * (B_e A_e)` with `A_e = A.reshape(E, r, n_in)[e]`, `B_e = B.reshape(n_out,
r, E)[:, :, e]` (peft's `get_delta_weight`). `n_in` is the input side whichever way the parameter
is laid out: `gate_up_proj` `[E, 2F, d]` (Qwen-MoE, Mixtral, OLMoE; its rows the gate's, then
up's) and gpt-oss's `[E, d, 2F]` (`is_transposed`; its columns gate and up by turns) both have
`n_in = d`, `n_out = 2F` in that parameter's order. Both parameters of one experts module are
wrapped one inside the other in the module's order, so with both targeted `gate_up_proj`'s
tensors are `...mlp.experts.base_layer.lora_{A,B}.weight` and `down_proj`'s
`...mlp.experts.lora_{A,B}.weight`; one alone is `...mlp.experts.lora_{A,B}.weight`.
Adapter trees nest as the parameters do (`jaxformer.lora.adapter_part`): the keys here are
`(block, part, adapter)`, `part` a module's path (`attn`, `mlp`, Gemma 4's `mlp/dense`, `mlp/experts`).
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np

from jaxformer.config import EXPERT_ADAPTERS, LINEAR_ADAPTERS, LORA_TARGETS, DecoderConfig, LoraConfig
from jaxformer.convert.hf import TEXT_PREFIX
from jaxformer.convert.safetensors_file import SafetensorsFile
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.experts import ExpertsSpec
from jaxformer.families import family_of
from jaxformer.families.common import Tensor, whole_shape
from jaxformer.files import read_json_object, write_atomically, write_text_atomically
from jaxformer.layers import layer_specs
from jaxformer.lora import PARTS, adapter_in_out, adapter_matrices, adapter_part, adapter_shapes, module_at
from jaxformer.validation import as_float, as_int, refuse

ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# An image-text checkpoint's (`jaxformer.convert.hf.TEXT_MODELS`: Qwen3.5's) text model's modules, as peft
# names them on transformers' image-text class: `base_model.model.model.language_model.layers.0...`.
IMAGE_TEXT_PREFIX = PEFT_PREFIX + TEXT_PREFIX
# transformers 5's module of a layer's experts (every family of experts; beside an MLP, `_experts_module`),
# and its parameters peft can adapt, by adapter, in the module's order (which nests their wrappers: the first
# innermost).
EXPERTS_MODULE = "model.layers.{i}.mlp.experts"
EXPERTS_PARAMETERS = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}

__all__ = ["adapter_shapes_of", "adapter_sizes", "all_targets", "check_targets", "load_peft", "peft_tensors",
           "save_peft"]


def all_targets(config: DecoderConfig, parameters: bool = False) -> tuple[str, ...]:
    """Every module target `config`'s checkpoint format has (peft's `target_modules`): Llama's
    seven projections, Phi-3's four (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`), a
    model of experts' attention's four (and those of its dense layers' MLP, if all are; Gemma 4's
    26B-A4B's MLP beside its experts, too); with `parameters`, then the parameters (peft's
    `target_parameters`): a model of experts' `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`
    (Gemma 4's `experts.gate_up_proj`, `experts.down_proj`: one name of each, the longest its
    checkpoint's parameters end in)."""
    targets = []
    for target, adapter in LORA_TARGETS.items():
        if (adapter in EXPERT_ADAPTERS and not parameters) or adapter in {LORA_TARGETS[t] for t in targets}:
            continue
        try:
            _peft_keys(config, LoraConfig(targets=(target,)))
        except ValueError:
            continue
        targets.append(target)
    return tuple(targets)


def check_targets(config: DecoderConfig, lora: LoraConfig) -> None:
    """Raises ValueError unless each of `lora.targets` is a module of `config`'s checkpoint
    format, as peft names it (Phi-3 has `qkv_proj` and `gate_up_proj`, the others `q_proj`,
    ...), or a parameter of its layers of experts as peft matches it (`mlp.experts.gate_up_proj`,
    or a dotted tail of the parameter's name: Gemma 4's `experts.gate_up_proj`, ...)."""
    try:
        _peft_keys(config, lora)
    except ValueError as e:
        raise ValueError(f"{e}; its targets: {', '.join(all_targets(config, parameters=True))}") from None


def _peft_keys(config: DecoderConfig, lora: LoraConfig) -> dict:
    """`(block, part, adapter) -> peft's key stem` (`base_model.model.model.layers.0.self_attn.q_proj`):
    the checkpoint tensor that holds the adapter's matrices, all of it; an experts' adapter's,
    its `ParamWrapper` in transformers' experts module (the module's docstring), in each layer
    of experts. A target applies to the layers that have its module, and only those (a hybrid's
    `q_proj` to its attention layers, `in_proj_qkv` to its Gated DeltaNet layers).

    Raises:
      ValueError: a target that no layer has, one whose matrices a layer keeps in another
        module, an MLP's target on a layer of experts, or an experts' parameter whose name
        the layers' is not nor ends in (Gemma 4's are not `mlp.experts.*`).
    """
    tensors = {t.path: t for t in family_of(config).tensors(config)}
    model_type = config.hf_model_type or "llama"
    specs = layer_specs(config)
    experts = [isinstance(spec.ffn, ExpertsSpec) for spec in specs]
    beside = [isinstance(spec.ffn, DenseAndExpertsSpec) for spec in specs]  # an MLP and experts (Gemma 4's)
    linear = [spec.mixer.attention_type == "linear" for spec in specs]
    wrapped = [adapter for adapter in EXPERTS_PARAMETERS if adapter in lora.adapters]
    stems = {}
    for target in lora.parameter_targets:
        if not any(experts) and not any(beside):
            raise ValueError(f"{target} is not a parameter of a {model_type} checkpoint (it has no layer of experts)")
    for i in range(config.n_layer):
        for target, adapter in zip(lora.targets, lora.adapters):
            part = adapter_part(adapter, beside[i])
            if adapter in EXPERT_ADAPTERS:
                if experts[i] or beside[i]:  # (a dense layer among them has no such parameter)
                    module = _experts_module(tensors, i, beside[i])
                    parameter = f"{module}.{EXPERTS_PARAMETERS[adapter]}"
                    if not (parameter == target or parameter.endswith("." + target)):  # (peft's match)
                        raise ValueError(f"{target} is not a parameter of a {model_type} checkpoint (layer {i}'s "
                                         f"experts hold {parameter})")
                    nesting = ".base_layer" * (len(wrapped) - 1 - wrapped.index(adapter))
                    stems[(f"block_{i}", part, adapter)] = PEFT_PREFIX + module + nesting
                continue
            if experts[i] and PARTS[adapter] == "mlp":
                raise ValueError(f"{target} is not a module of a {model_type} checkpoint (layer {i}'s MLP is its "
                                 "experts, whose matrices are parameters: mlp.experts.gate_up_proj, "
                                 "mlp.experts.down_proj)")
            if PARTS[adapter] == "attn" and (adapter in LINEAR_ADAPTERS) != linear[i]:
                continue  # (a Gated DeltaNet layer's module in an attention layer, or the other way round)
            members = [tensors.get((f"block_{i}", *part.split("/"), m)) for m in adapter_matrices(adapter)]
            if None in members:
                continue  # (a latent attention's targets on another attention, or the other way round)
            parts = [t for t in tensors.values() if t.hf_key == members[0].hf_key]
            # The adapter is the tensor's: its matrices are all of it (its parts, each once) or it alone.
            whole = len(members) == len(parts) and all(t.hf_key == members[0].hf_key for t in members) and (
                len(members) == 1 or sorted(np.concatenate([_rows_of(t) for t in members]).tolist())
                == list(range(whole_shape(parts)[0])))
            hf_key = members[0].hf_key
            if not whole or not hf_key.endswith(f".{target}.weight"):
                raise ValueError(f"{target} is not a module of a {model_type} checkpoint (layer {i}'s "
                                 f"{'/'.join(members[0].path[1:])} is in {hf_key})")
            stems[(f"block_{i}", part, adapter)] = PEFT_PREFIX + hf_key.removesuffix(".weight")
    for target, adapter in zip(lora.targets, lora.adapters):
        if not any(key[2] == adapter for key in stems):
            why = ("it has no Gated DeltaNet layer" if adapter in LINEAR_ADAPTERS and not any(linear)
                   else f"no layer's {PARTS[adapter]} has {' and '.join(adapter_matrices(adapter))}")
            raise ValueError(f"{target} is not a module of a {model_type} checkpoint ({why})")
    return stems


def _experts_module(tensors: dict, i: int, beside: bool) -> str:
    """transformers' module of layer i's experts: `EXPERTS_MODULE`, or beside an MLP the one its
    checkpoint keeps them in (Gemma 4's `model.layers.i.experts`, beside `model.layers.i.mlp`)."""
    if not beside:
        return EXPERTS_MODULE.format(i=i)
    return tensors[(f"block_{i}", "mlp", "experts", "w_down")].hf_key.removesuffix(".down_proj")


def _rows_of(part: Tensor) -> np.ndarray:
    """The rows of its whole checkpoint tensor (a torch Linear's outputs) that a part of it is, in
    the order of the part's output channels as jaxformer's matrix holds them."""
    if part.rows is not None:
        return np.arange(*part.rows)
    if part.grouped is not None:
        return part.index[0]
    return np.arange(part.hf_shape[0])


def _peft_rows(config: DecoderConfig, block: str, part: str, adapter: str) -> np.ndarray | None:
    """For a module adapter whose matrices are rows of one checkpoint tensor not one after
    another (Qwen3-Next's `in_proj_qkvz`, `in_proj_ba`: each key head's rows together), the
    columns of its `b` (its matrices' one after another) in the order of peft's rows of
    `lora_B`, the tensor's; None where they are that order already."""
    tensors = {t.path: t for t in family_of(config).tensors(config)}
    members = [tensors[(block, *part.split("/"), m)] for m in adapter_matrices(adapter)]
    if all(t.grouped is None for t in members):
        return None
    rows = np.concatenate([_rows_of(t) for t in members])  # our column -> the tensor's row
    return np.argsort(rows)  # the tensor's row -> our column


def save_peft(config: DecoderConfig, adapters: dict, lora: LoraConfig, path: str, *,
              base_model: str | None = None, image_text: bool = False) -> None:
    """Writes `adapter_config.json` and `adapter_model.safetensors` as peft writes them, so that
    `peft.PeftModel.from_pretrained(base, path)` loads the adapters (each file atomically); with
    `image_text`, named for transformers' image-text class of the base (Qwen3.5's shipped
    checkpoints: its text model's modules under `model.language_model`)."""
    from safetensors.numpy import save

    os.makedirs(path, exist_ok=True)
    tensors = {name: np.asarray(x, np.float32)
               for name, x in peft_tensors(config, adapters, lora, image_text=image_text).items()}
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                      "target_modules": sorted(lora.module_targets),
                      "target_parameters": sorted(lora.parameter_targets) or None, "lora_dropout": lora.dropout,
                      "bias": "none", "lora_bias": False, "use_dora": False, "fan_in_fan_out": False,
                      "use_rslora": False, "base_model_name_or_path": base_model, "inference_mode": True}
    data = save(tensors, metadata={"format": "pt"})
    write_atomically(os.path.join(path, ADAPTER_WEIGHTS_FILE), lambda tmp: tmp.write_bytes(data))
    write_text_atomically(os.path.join(path, ADAPTER_CONFIG_FILE), json.dumps(adapter_config, indent=2) + "\n")


def peft_tensors(config: DecoderConfig, adapters: dict, lora: LoraConfig, image_text: bool = False
                 ) -> dict[str, np.ndarray]:
    """`adapters` (or anything shaped as them: their gradients) as peft's tensors, by the names
    `adapter_model.safetensors` holds them under (`...lora_A.weight`, `...lora_B.weight`; with
    `image_text`, an image-text base's, `save_peft`), in their dtype."""
    tensors = {}
    for (block, part, name), stem in _peft_keys(config, lora).items():
        if image_text:
            stem = IMAGE_TEXT_PREFIX + stem.removeprefix(PEFT_PREFIX + "model.")
        ab = module_at(adapters, block, part)[name]
        a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
        if name in EXPERT_ADAPTERS:  # [E, r, n_in] and [E, r, n_out] as peft's [E * r, n_in] and [n_out, r * E]
            b = b[:, :, _peft_columns(config, block, part, name)]
            a, b = a.reshape(-1, a.shape[-1]), b.transpose(2, 1, 0).reshape(b.shape[-1], -1)
        else:
            order = _peft_rows(config, block, part, name)
            b = (b if order is None else b[:, order]).T  # [n_out, r], the tensor's rows
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a)  # [r, n_in]
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b)
    return tensors


def _peft_columns(config: DecoderConfig, block: str, part: str, adapter: str) -> np.ndarray:
    """The columns of an experts' adapter's `b` (gate's, then up's) in the order of peft's rows
    of `lora_B`: transformers' fused parameter's (gpt-oss's gate and up by turns, as its
    checkpoint tensor's `columns`; every other family's the gate's, then up's)."""
    tensors = {t.path: t for t in family_of(config).tensors(config)}
    parts = [tensors[(block, *part.split("/"), m)] for m in EXPERT_ADAPTERS[adapter]]
    width = parts[0].shape[-1]
    if parts[0].columns is None:
        return np.arange(width * len(parts))
    order = np.empty(width * len(parts), np.int64)  # peft's column -> ours
    for k, part in enumerate(parts):
        first, step = part.columns
        order[first::step] = np.arange(k * width, (k + 1) * width)
    return order


def _stacked_shapes(config: DecoderConfig, lora: LoraConfig) -> dict:
    """`(block, part, adapter) -> [shape of each matrix it changes]` as the parameter tree holds them."""
    check_targets(config, lora)
    shapes = {t.path: t.shape for t in family_of(config).tensors(config)}
    specs = layer_specs(config)
    out = {}
    for block, part, name in _peft_keys(config, lora):
        if name in EXPERT_ADAPTERS:
            ffn = specs[int(block.split("_")[1])].ffn
            weights = (ffn.experts if isinstance(ffn, DenseAndExpertsSpec) else ffn).weights(config.d_model)
            out[(block, part, name)] = [weights[m].shape for m in adapter_matrices(name)]
        else:
            out[(block, part, name)] = [shapes[(block, *part.split("/"), m)] for m in adapter_matrices(name)]
    return out


def adapter_sizes(config: DecoderConfig, lora: LoraConfig) -> dict[tuple[str, str, str], tuple[int, int]]:
    """`(block, part, adapter) -> (n_in, n_out)` of every adapter `lora` gives a model of
    `config`, from the config alone: `a` is `[rank, n_in]`, `b` `[rank, n_out]` (an experts'
    adapter's: each expert's, `adapter_shapes_of`).

    Raises:
      ValueError: a target that `config`'s checkpoint format lacks (`check_targets`).
    """
    return {key: adapter_in_out(key[2], [shape[1:] if key[2] in EXPERT_ADAPTERS else shape for shape in shapes])
            for key, shapes in _stacked_shapes(config, lora).items()}


def adapter_shapes_of(config: DecoderConfig, lora: LoraConfig) -> dict[tuple[str, str, str], tuple[tuple, tuple]]:
    """`(block, part, adapter) -> (shape of a, shape of b)` of every adapter `lora` gives a model
    of `config` (`jaxformer.lora.adapter_shapes`), from the config alone.

    Raises:
      ValueError: a target that `config`'s checkpoint format lacks (`check_targets`).
    """
    return {key: adapter_shapes(key[2], shapes, lora.rank) for key, shapes in _stacked_shapes(config, lora).items()}


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
    lora = _read_adapter_config(os.path.join(path, ADAPTER_CONFIG_FILE), path, config)
    file = os.path.join(path, ADAPTER_WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: missing (a peft adapter folder holds it; adapter_model.bin, torch's pickle "
                                "format, is not read: save with safe_serialization=True)")
    try:
        shapes = adapter_shapes_of(config, lora)
    except ValueError as e:
        field = "target_parameters" if str(e).startswith(lora.parameter_targets) else "target_modules"
        raise ValueError(f"{os.path.join(path, ADAPTER_CONFIG_FILE)}: {field}: {e}") from None
    want = {}  # tensor name -> (adapter's key, "a" or "b", the shape peft stores it in)
    for key, stem in _peft_keys(config, lora).items():
        (*experts, _, n_in), (*_, n_out) = shapes[key]
        rows = math.prod(experts) * lora.rank  # (E * r for an experts' adapter)
        want[f"{stem}.lora_A.weight"] = (key, "a", (rows, n_in))
        want[f"{stem}.lora_B.weight"] = (key, "b", (n_out, rows))
    stored = SafetensorsFile(file)
    # (An image-text base's names, `save_peft`'s `image_text`, read as its text model's.)
    named = {PEFT_PREFIX + "model." + k.removeprefix(IMAGE_TEXT_PREFIX) if k.startswith(IMAGE_TEXT_PREFIX) else k: k
             for k in stored.keys}
    for names, what in ((sorted(want.keys() - named.keys()), "lacks"), (sorted(named.keys() - want.keys()), "holds")):
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ValueError(f"{file} {what} {names[0]}{more}: not the adapters its adapter_config.json describes for "
                             f"this {config.hf_model_type or 'llama'} checkpoint ({config.n_layer} layers, targets "
                             f"{', '.join(lora.targets)}, r={lora.rank})")
    adapters: dict = {}
    for name, ((block, part, adapter), letter, shape) in want.items():
        if stored.shape(named[name]) != shape:
            raise ValueError(f"{file}: {named[name]} is {stored.shape(named[name])}, not {shape}")
        value = np.asarray(stored.tensor(named[name]), np.float32)
        if not np.isfinite(value).all():
            raise ValueError(f"{file}: {named[name]} holds NaN or inf: not a usable adapter (a run that diverged, "
                             "or a damaged file)")
        pair = module_at(adapters, block, part, create=True).setdefault(adapter, {})
        if adapter not in EXPERT_ADAPTERS:
            order = None if letter == "a" else _peft_rows(config, block, part, adapter)
            value = value if letter == "a" else value.T if order is None else value[np.argsort(order)].T
        elif letter == "a":
            value = value.reshape(-1, lora.rank, shape[-1])  # [E, r, n_in]
        else:  # [n_out, r * E] -> [E, r, n_out], the columns back in ours (gate's, then up's)
            value = value.reshape(shape[0], lora.rank, -1).transpose(2, 1, 0)
            value = value[:, :, np.argsort(_peft_columns(config, block, part, adapter))]
        pair[letter] = jnp.asarray(value)
    return adapters, lora


def _read_adapter_config(file: str, path: str, config: DecoderConfig) -> LoraConfig:
    """The `LoraConfig` of a peft `adapter_config.json`, its JSON types checked: its
    `target_modules`, and its `target_parameters` by the names peft matches them with (a
    dotted tail of `mlp.experts.gate_up_proj` or `mlp.experts.down_proj`), each read as the
    target `config`'s checkpoint spells it where it has one (Gemma 4's `experts.gate_up_proj`)."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG_FILE} there: not a peft adapter folder")
    given = read_json_object(file)
    for key, plain in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False), ("fan_in_fan_out", False),
                       ("rank_pattern", {}), ("alpha_pattern", {}), ("lora_bias", False), ("use_dora", False)):
        if given.get(key, plain) not in (plain, None):
            raise ValueError(f"{file}: {key} {given[key]!r} is not read here (only {plain!r})")
    parameters = given.get("target_parameters")
    if not (parameters is None or (isinstance(parameters, list) and all(isinstance(t, str) for t in parameters))):
        refuse(f"{file}: target_parameters", "null or a list of parameter names", parameters)
    parameters = parameters or []
    targets = given.get("target_modules")
    targets = [targets] if isinstance(targets, str) else [] if targets is None and parameters else targets
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        refuse(f"{file}: target_modules", "a module name or a list of them", given.get("target_modules"))
    known = [t for t, adapter in LORA_TARGETS.items() if adapter in EXPERT_ADAPTERS]
    longest = [t for t in known if not any(other.endswith("." + t) for other in known)]  # (the rest: their tails)
    spelled = all_targets(config, parameters=True) if parameters else ()
    for name in parameters:  # peft adapts the parameters whose name is it or ends in "." + it
        matched = [t for t in known if t == name or t.endswith("." + name)]
        if not matched:
            raise ValueError(f"{file}: target_parameters: {name!r} is not read here (only the experts' "
                             f"{', '.join(longest)}, or a dotted tail of one)")
        targets.append(next((t for t in matched if t in spelled), matched[0]))
    rank = as_int(given.get("r"), f"{file}: r", minimum=1)
    alpha = as_float(given.get("lora_alpha"), f"{file}: lora_alpha", above=0)
    dropout = as_float(given.get("lora_dropout") or 0.0, f"{file}: lora_dropout", at_least=0, below=1)
    try:
        return LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets), dropout=dropout)
    except ValueError as e:  # (the rest is checked above: only the targets, and dropout with parameters, are left)
        field = "lora_dropout" if "dropout" in str(e) else "target_modules"
        raise ValueError(f"{file}: {field}: {e}") from None
