"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2) to and from `Decoder`.

A torch `Linear` stores `[out, in]`; jaxformer stores `[in, out]` split into heads
(`wq: [d_model, n_head, head_dim]`). One table (`_tensor_table`) lists each tensor once,
and `load_hf` and `save_hf` read it in opposite directions. What loads, what is refused
and what a folder may not do are in docs/parity.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxformer.config import ROPE_SCALINGS, DecoderConfig, RopeScaling
from jaxformer.convert.layers import with_scan_layers
from jaxformer.convert.rope_pairing import with_rope_pairing
from jaxformer.files import write_atomically, write_text_atomically
from jaxformer.validation import as_int, finite_float, python_int

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default when config.json names none


_REQUIRED = object()  # `_field`'s default: the field must be present


def _fail(field: str, rule: str, value: Any) -> None:
    raise ValueError(f"config.json {field}: {rule} (got {value!r})")


def _field(hf: dict, key: str, convert: Callable[[Any], Any], rule: str, *, default: Any = _REQUIRED,
           where: str | None = None) -> Any:
    """`config.json`'s `key` through `convert` (None: the wrong kind), checked positive;
    `default` when absent or null, else a ValueError naming the field (inside `where`, an
    object of config.json, if given) and `rule`."""
    name = key if where is None else f"{where}.{key}"
    if hf.get(key) is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json {name}: missing; it must be {rule}")
        return default
    value = convert(hf[key])
    if value is None or not value > 0:
        _fail(name, f"must be {rule}", hf[key])
    return value


def _read_json(path: str) -> Any:
    """The parsed JSON file at `path`; a `ValueError` naming the file if it does not parse."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling, from `rope_parameters` (transformers >= 5) or the older
    top-level `rope_theta` and `rope_scaling`.

    A variant the decoder does not compute (longrope, dynamic...) changes the angles:
    refused, never loaded as plain RoPE."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        _fail("rope_parameters", "must be an object", params)
    if "rope_type" not in params and params and all(
            isinstance(v, dict) for v in params.values()):
        _fail("rope_parameters", "per-layer-type RoPE parameters are not supported", params)
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        _fail("rope_scaling", "must be an object or null", scaling)
    where, given = ("rope_parameters", params) if "rope_type" in params or "type" in params else (
        "rope_scaling", scaling or {})
    rope_type = given.get("rope_type", given.get("type", "default"))
    stale = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if where == "rope_parameters" and stale not in ("default", rope_type):
        _fail("rope_scaling", f"contradicts rope_parameters.rope_type={rope_type!r}", scaling)
    if rope_type not in ("default", *ROPE_SCALINGS):
        _fail(f"{where}.rope_type", f"must be one of {('default', *ROPE_SCALINGS)}", rope_type)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        _fail("partial_rotary_factor", "RoPE must rotate every channel (1.0)", hf["partial_rotary_factor"])
    theta = _field(params if "rope_theta" in params else hf, "rope_theta", finite_float, "a finite number > 0",
                   default=DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return theta, None

    def number(key: str, convert=finite_float, rule: str = "a finite number > 0", default: Any = _REQUIRED):
        return _field(given, key, convert, rule, where=where, default=default)

    if rope_type == "linear":
        return theta, RopeScaling("linear", number("factor"))
    context = number("original_max_position_embeddings", python_int, "a positive int")
    if rope_type == "yarn":
        return theta, _yarn(hf, given, where, number, context)
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if not high > low:
        _fail(f"{where}.high_freq_factor", f"must be above low_freq_factor={low:g}", high)
    return theta, RopeScaling("llama3", number("factor"), context, low_freq_factor=low, high_freq_factor=high)


def _yarn(hf: dict, given: dict, where: str, number: Callable, context: int) -> RopeScaling:
    """YaRN's fields, with transformers' defaults: `factor` from the two contexts when
    absent, and the attention factor from `mscale` / `mscale_all_dim` when given."""
    factor = number("factor", default=None)
    if factor is None:
        factor = _field(hf, "max_position_embeddings", python_int, "a positive int") / context
    attention_factor = number("attention_factor", default=None)
    mscale, mscale_all_dim = number("mscale", default=None), number("mscale_all_dim", default=None)
    if attention_factor is None and mscale and mscale_all_dim:

        def m(weight: float) -> float:  # YaRN's 0.1 * weight * ln(factor) + 1
            return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

        attention_factor = m(mscale) / m(mscale_all_dim)
    truncate = given.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        _fail(f"{where}.truncate", "must be true or false", truncate)
    return RopeScaling("yarn", factor, context, beta_fast=number("beta_fast", default=None),
                       beta_slow=number("beta_slow", default=None), attention_factor=attention_factor,
                       truncate=truncate)


def _sliding_window(hf: dict) -> int | None:
    """The attention window, or None when every layer attends to the whole prefix."""
    if hf["model_type"] == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    return _field(hf, "sliding_window", python_int, "a positive int or null", default=None)


def config_from_hf(hf: dict, *, max_seq_len: int | None = None, dtype=jnp.float32) -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face `config.json` (as a dict).

    Args:
      hf: the parsed `config.json`.
      max_seq_len: longest sequence to accept; defaults to `max_position_embeddings`.
        A checkpoint with a sliding window loads with `max_seq_len` up to the window.
      dtype: compute dtype of the returned config.

    Raises:
      ValueError: naming the `config.json` field that is missing, malformed, or that
        the decoder cannot represent.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    if max_seq_len is not None:
        max_seq_len = as_int(max_seq_len, "max_seq_len", minimum=1)
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        _fail("model_type", f"must be one of {sorted(ARCHITECTURES)}", model_type)
    if hf.get("hidden_act", "silu") != "silu":
        _fail("hidden_act", "the SwiGLU gate must be 'silu'", hf["hidden_act"])
    for flag in ("attention_bias", "mlp_bias"):  # Llama's flags; they also add an o_proj / MLP bias
        if hf.get(flag, False):
            _fail(flag, "must be false (only Qwen2's q/k/v biases are supported)", hf[flag])
    rope_theta, rope_scaling = _rope(hf)
    if max_seq_len is None:
        max_seq_len = _field(hf, "max_position_embeddings", python_int, "a positive int")
    window = _sliding_window(hf)
    if window is not None and window < max_seq_len:
        _fail("sliding_window", f"an active window is not supported: it is shorter than max_seq_len={max_seq_len}; "
              f"load with max_seq_len <= {window} to use the model within its window", window)
    tie_embeddings = hf.get("tie_word_embeddings")
    tie_embeddings = False if tie_embeddings is None else tie_embeddings
    if not isinstance(tie_embeddings, bool):  # bool("false") would be True
        _fail("tie_word_embeddings", "must be true or false", tie_embeddings)
    layer_types = hf.get("layer_types") or ["full_attention"]
    if window is None and (not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)):
        _fail("layer_types", "every layer must be 'full_attention'", hf["layer_types"])

    def positive_int(key: str, default: Any = _REQUIRED) -> int:
        return _field(hf, key, python_int, "a positive int", default=default)

    d_model, n_head = positive_int("hidden_size"), positive_int("num_attention_heads")
    head_dim = positive_int("head_dim", default=d_model // n_head)
    return DecoderConfig(
        vocab_size=positive_int("vocab_size"),
        n_layer=positive_int("num_hidden_layers"),
        n_head=n_head,
        n_kv_head=positive_int("num_key_value_heads", default=n_head),
        d_model=d_model,
        max_seq_len=max_seq_len,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=_field(hf, "rms_norm_eps", finite_float, "a finite number > 0"),
        d_ff=positive_int("intermediate_size"),
        rope_pairing="split_half",  # the only pairing transformers implements
        tie_embeddings=tie_embeddings,
        dtype=dtype,
        head_dim_override=None if head_dim * n_head == d_model else head_dim,
        qkv_bias=model_type == "qwen2",
    )


def _rope_parameters(config: DecoderConfig) -> dict:
    """`rope_parameters` as transformers >= 5 writes it: the type, the base and the scaling's fields."""
    scaling = config.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if k != "kind" and v is not None}
    return {"rope_type": scaling.kind, "rope_theta": config.rope_theta, **fields}


def config_to_hf(config: DecoderConfig, *, bos_id: int | None = None, eos_id: int | list[int] | None = None,
                 pad_id: int | None = None) -> dict:
    """The `config.json` (as a dict) of a `DecoderConfig`: Qwen2 if it has q/k/v biases, else Llama.

    Args:
      config: the config.
      bos_id, eos_id, pad_id: the tokenizer's special ids (the config knows none); None
        leaves them null.
    """
    model_type = "qwen2" if config.qkv_bias else "llama"
    hf = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": _rope_parameters(config),
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One checkpoint tensor: its name and shape there, its place and shape in jaxformer's tree."""

    hf_key: str
    hf_shape: tuple[int, ...]
    path: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False  # a torch Linear weight: [out, in] there, [in, out] (split into heads) here

    def to_jax(self, w: np.ndarray) -> np.ndarray:
        return (w.T if self.transpose else w).reshape(self.shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(self.hf_shape[::-1]).T if self.transpose else w.reshape(self.hf_shape)


def _tensor_table(c: DecoderConfig) -> list[_Tensor]:
    """Every tensor of the checkpoint: name, `[out, in]` shape there; path, shape here."""
    V, d, H, K, D, F = c.vocab_size, c.d_model, c.n_head, c.n_kv_head, c.head_dim, c.ffn_dim
    table = [_Tensor("model.embed_tokens.weight", (V, d), ("embed",), (V, d)),
             _Tensor("model.norm.weight", (d,), ("final_norm", "weight"), (d,))]
    if not c.tie_embeddings:  # a tied checkpoint has no lm_head.weight: it is embed_tokens
        table.append(_Tensor("lm_head.weight", (V, d), ("lm_head",), (d, V), transpose=True))
    for i in range(c.n_layer):
        hf, block = f"model.layers.{i}.", f"block_{i}"
        table += [
            _Tensor(hf + "input_layernorm.weight", (d,), (block, "attn_norm", "weight"), (d,)),
            _Tensor(hf + "self_attn.q_proj.weight", (H * D, d), (block, "attn", "wq"), (d, H, D), transpose=True),
            _Tensor(hf + "self_attn.k_proj.weight", (K * D, d), (block, "attn", "wk"), (d, K, D), transpose=True),
            _Tensor(hf + "self_attn.v_proj.weight", (K * D, d), (block, "attn", "wv"), (d, K, D), transpose=True),
            _Tensor(hf + "self_attn.o_proj.weight", (d, H * D), (block, "attn", "wo"), (H, D, d), transpose=True),
            _Tensor(hf + "post_attention_layernorm.weight", (d,), (block, "mlp_norm", "weight"), (d,)),
            _Tensor(hf + "mlp.gate_proj.weight", (F, d), (block, "mlp", "w_gate"), (d, F), transpose=True),
            _Tensor(hf + "mlp.up_proj.weight", (F, d), (block, "mlp", "w_up"), (d, F), transpose=True),
            _Tensor(hf + "mlp.down_proj.weight", (d, F), (block, "mlp", "w_down"), (F, d), transpose=True),
        ]
        if c.qkv_bias:
            table += [_Tensor(hf + f"self_attn.{x}_proj.bias", (n * D,), (block, "attn", f"b{x}"), (n, D))
                      for x, n in (("q", H), ("k", K), ("v", K))]
    return table


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder, as float32 numpy arrays, each from the shard the
    index's `weight_map` names (through the flax loader, which reads bfloat16)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map each tensor name to its shard file")
        shards: dict[str, list[str] | None] = {}
        for key, name in weight_map.items():
            _check_inside(path, name, f"{index}: weight_map entry {key!r}")
            shards.setdefault(name, []).append(key)
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        shards = {"model.safetensors": None}  # None: every tensor of the file
        _check_inside(path, "model.safetensors", os.path.join(path, "model.safetensors"))
    else:
        raise FileNotFoundError(f"path: no model.safetensors or model.safetensors.index.json in {path}")
    tensors = {}
    for name, keys in sorted(shards.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: missing; {index} lists it")
        tensors.update(_read_shard(file, keys, f"{index}: weight_map puts"))
    return tensors


def _read_shard(file: str, keys: list[str] | None, assigned: str) -> dict[str, np.ndarray]:
    """The tensors `keys` of one safetensors file (None: all), as float32 numpy arrays;
    a ValueError if it does not parse or lacks one (starting with `assigned`)."""
    try:
        with safe_open(file, framework="flax") as f:
            held = set(f.keys())
            absent = sorted(set(keys or ()) - held)
            if not absent:
                return {key: np.asarray(f.get_tensor(key).astype(jnp.float32)) for key in keys or held}
    except SafetensorError as e:  # truncated, garbage, a bad header: the reader says which
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
    raise ValueError(f"{assigned} {absent[0]!r}{more} in {os.path.basename(file)}, but {file} does not hold it")


def _check_inside(folder: str, name: str, where: str) -> None:
    """A ValueError naming `where` unless `name` is relative, has no `..`, and stays inside
    `folder` once symlinks are resolved (for a hub snapshot, inside its repository)."""
    if os.path.isabs(name) or ".." in re.split(r"[\\/]", name):
        raise ValueError(f"{where}: {name!r} is not a file inside the checkpoint folder (an absolute path, or "
                         "one through '..')")
    root = os.path.realpath(folder)
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(os.path.dirname(snapshots)).startswith(
            "models--"):
        root = os.path.dirname(snapshots)  # the hub cache's repository: its snapshots link to its blobs
    target = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([root, target]) != root:
        raise ValueError(f"{where}: {name!r} resolves to {target}, outside {root}")


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def load_hf(path: str, *, max_seq_len: int | None = None, dtype=jnp.float32, scan_layers: bool = False):
    """Loads a Hugging Face `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` folder.

    Args:
      path: a folder as `save_pretrained` writes it: `config.json`, `model.safetensors` or
        shards with `model.safetensors.index.json`.
      max_seq_len: longest sequence the model accepts; default `max_position_embeddings`
        (see `config_from_hf` for sliding windows).
      dtype: compute dtype of the returned config (parameters stay float32).
      scan_layers: return the scanned form (`DecoderConfig.scan_layers`, parameters stacked).

    Returns:
      `(config, params)`: a `DecoderConfig` and the parameter tree for `Decoder(config)`.

    Raises:
      FileNotFoundError: `path`, its `config.json` or its weights do not exist.
      ValueError: naming the file and what is wrong with it (docs/parity.md lists what is refused).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint folder holding config.json and model.safetensors "
                         f"(got the file {path!r})")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: missing; a Hugging Face checkpoint folder holds config.json")
    hf = _read_json(config_path)
    try:
        config = config_from_hf(hf, max_seq_len=max_seq_len, dtype=dtype)
    except ValueError as e:  # say which checkpoint; the message names the field
        raise ValueError(f"{path}: {e}") from None
    tensors = _read_safetensors(path)
    # Older checkpoints store RoPE's inverse frequencies; they follow from rope_theta.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints store the head anyway; it must be the embedding itself.
        head = tensors.pop("lm_head.weight")
        if not np.array_equal(head, tensors.get("model.embed_tokens.weight")):
            raise ValueError(f"{path}: config.json tie_word_embeddings: is true but lm_head.weight differs from "
                             "model.embed_tokens.weight")
    table = _tensor_table(config)
    missing = sorted({t.hf_key for t in table} - tensors.keys())
    unexpected = sorted(tensors.keys() - {t.hf_key for t in table})
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match config.json: missing {missing}, unexpected {unexpected}")
    params: dict = {}
    for t in table:
        w = tensors[t.hf_key]
        if w.shape != t.hf_shape:
            raise ValueError(f"{path}: {t.hf_key}: expected shape {t.hf_shape} from config.json, got {tuple(w.shape)}")
        _set(params, t.path, jnp.asarray(t.to_jax(w)))
    return with_scan_layers(config, params, scan_layers)


def save_hf(config: DecoderConfig, params, path: str, *, bos_id: int | None = None,
            eos_id: int | list[int] | None = None, pad_id: int | None = None) -> None:
    """Writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Llama, or Qwen2 with q/k/v biases; an interleaved-RoPE model is saved permuted to
    split-half, the only pairing transformers implements.

    Args:
      config: the `DecoderConfig` (either `scan_layers` form).
      params: the `Decoder` parameter tree.
      path: the folder (created if needed); each file in it is replaced atomically.
      bos_id, eos_id, pad_id: the tokenizer's special ids (`eos_id` may list several), for
        `config.json` and `generation_config.json`, where readers find the stop ids.

    Raises:
      OSError: naming the file, when the folder cannot be written (a full disk).
    """
    config, params = with_scan_layers(config, params, False)  # the checkpoint names each layer
    config, params = with_rope_pairing(config, params, "split_half")
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for t in _tensor_table(config):
        w = np.asarray(_get(params, t.path), np.float32)
        if w.shape != t.shape:
            raise ValueError(f"params{''.join(f'[{p!r}]' for p in t.path)}: expected shape {t.shape}, "
                             f"got {tuple(w.shape)}")
        tensors[t.hf_key] = np.ascontiguousarray(t.to_hf(w))
    write_atomically(os.path.join(path, "model.safetensors"), lambda tmp: _save_safetensors(tensors, tmp))
    special = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    write_text_atomically(os.path.join(path, "generation_config.json"), json.dumps(generation, indent=2))
    write_text_atomically(os.path.join(path, "config.json"), json.dumps(config_to_hf(config, **special), indent=2))


def _save_safetensors(tensors: dict[str, np.ndarray], path) -> None:
    """`save_file`, with a failure to write (a full disk) raised as the `OSError` it is."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:  # "... I/O error: No space left on device (os error 28)"
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def _get(tree, path: tuple[str, ...]):
    for depth, name in enumerate(path):
        if not isinstance(tree, dict) or name not in tree:
            raise ValueError(f"params has no {'/'.join(path[:depth + 1])}: not a Decoder(config) parameter tree")
        tree = tree[name]
    return tree
