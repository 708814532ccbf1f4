"""Hugging Face checkpoints to and from `Decoder`: the families of `jaxformer.families`, each
family's config and tensor names in its module; an image-text checkpoint's text model
(`TEXT_MODELS`) is read as its family's.

A torch `Linear` stores `[out, in]`; jaxformer stores `[in, out]` split into heads
(`wq: [d_model, n_head, head_dim]`). One table per family lists each tensor once, and
`load_hf` and `save_hf` read it in opposite directions. What loads, what is refused and
what a folder may not do are in docs/parity.md.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxformer.config import DecoderConfig
from jaxformer.convert.layers import block_name, with_scan_layers
from jaxformer.convert.rope_pairing import with_rope_pairing
from jaxformer.convert.safetensors_file import SafetensorsFile, write_safetensors
from jaxformer.decoder import Decoder
from jaxformer.families import FAMILIES, family_of
from jaxformer.families.common import Tensor, common_hf_fields, fail, whole_shape
from jaxformer.files import read_json_object, write_atomically, write_text_atomically
from jaxformer.layers import layer_specs, scanned_places
from jaxformer.quantized import (
    MATRICES,
    QArray,
    Quantization,
    Quantized,
    check_group,
    format_of,
    from_fp8,
    from_mxfp4,
    full_scale,
    input_axes,
    stored,
    to_fp8,
    to_mxfp4,
)
from jaxformer.quantized import dequantize as dequantize_matrix
from jaxformer.quantized import quantize as quantize_matrix
from jaxformer.sharding import param_axes, put, quantized_shardings
from jaxformer.validation import as_int

# Image-text checkpoints whose text model is a family's: their config.json's `model_type`, and its text
# model's (`text_config`), whose tensors are `model.language_model.*` (the family's `model.*`) and
# `lm_head.weight`. The other towers' tensors (vision, audio) are left unread.
TEXT_MODELS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text"}
TEXT_PREFIX = "model.language_model."


def text_model(hf: dict) -> dict:
    """`hf` itself, or for an image-text checkpoint (`TEXT_MODELS`) its text model's config.json
    (`text_config`, given the outer `tie_word_embeddings` where it states none)."""
    if hf.get("model_type") not in TEXT_MODELS:
        return hf
    inner, want = hf.get("text_config"), TEXT_MODELS[hf["model_type"]]
    if not isinstance(inner, dict):
        fail("text_config", f"must be an object: a {hf['model_type']} checkpoint's text model", inner)
    if inner.get("model_type", want) != want:
        fail("text_config.model_type", f"must be {want!r} in a {hf['model_type']} checkpoint", inner["model_type"])
    outer = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf else {}
    return {**outer, **inner, "model_type": want}


def config_from_hf(hf: dict, *, max_seq_len: int | None = None, dtype=jnp.float32, param_dtype=None
                   ) -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face `config.json` (as a dict).

    Args:
      hf: the parsed `config.json`; its `model_type` picks the family (`jaxformer.families.FAMILIES`),
        or for an image-text checkpoint (`TEXT_MODELS`) its text model's does.
      max_seq_len: longest sequence to accept; defaults to `max_position_embeddings`.
      dtype: compute dtype of the returned config.
      param_dtype: storage dtype of the parameters; None: `dtype`.

    Raises:
      ValueError: naming the `config.json` field that is missing, malformed, or that
        the decoder cannot represent.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    if max_seq_len is not None:
        max_seq_len = as_int(max_seq_len, "max_seq_len", minimum=1)
    wrapped, hf = hf.get("model_type") in TEXT_MODELS, text_model(hf)
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        fail("model_type", f"must be one of {sorted(FAMILIES)}", model_type)
    shipped_quantization(hf)  # (refuses a quantization_config that is not read)
    try:
        fields = FAMILIES[model_type].read(hf, max_seq_len)
    except ValueError as e:  # (an image-text checkpoint's text model: its fields are text_config's)
        if not wrapped:
            raise
        raise ValueError(str(e).replace("config.json ", "config.json text_config.", 1)) from None
    return DecoderConfig(**fields, dtype=dtype, param_dtype=dtype if param_dtype is None else param_dtype,
                         hf_model_type=model_type)


def shipped_quantization(hf: dict) -> tuple[str, tuple[int, int] | None] | None:
    """The format a checkpoint's matrices ship in, from its `quantization_config`: `("mxfp4", None)`
    (gpt-oss: `X_blocks` and `X_scales` for a matrix `X`), `("fp8", (bo, bi))` (DeepSeek-V3, Qwen3's
    `-FP8`: float8 e4m3 `X.weight` and `X.weight_scale_inv` a block of `bo x bi`), or None (none).

    Raises:
      ValueError: naming the field, for another method or an FP8 block or format not read.
    """
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        fail("quantization_config", "must be an object", quant)
    method = quant.get("quant_method")
    if method == "mxfp4":
        return "mxfp4", None
    if method != "fp8":
        fail("quantization_config.quant_method", "must be 'mxfp4' or 'fp8' (read as shipped), or no "
             "quantization_config (quantize on load instead: load_hf(quantize=...))", method)
    if quant.get("fmt", "e4m3") != "e4m3":
        fail("quantization_config.fmt", "must be 'e4m3'", quant["fmt"])
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        fail("quantization_config.weight_block_size", "must be two positive ints (a scale per block of a "
             "weight's rows and columns; per-tensor FP8 is not read)", block)
    return "fp8", tuple(block)


def config_to_hf(config: DecoderConfig, *, bos_id: int | None = None, eos_id: int | list[int] | None = None,
                 pad_id: int | None = None) -> dict:
    """The `config.json` (as a dict) of a `DecoderConfig`, in its family's format (`hf_model_type`).

    Args:
      config: the config.
      bos_id, eos_id, pad_id: the tokenizer's special ids (the config knows none); None
        leaves them null.

    Raises:
      ValueError: the config has a feature its family's format cannot hold.
    """
    family = family_of(config)
    family.check_fits(config)
    return {"architectures": [family.architecture], "model_type": family.model_type, **common_hf_fields(config),
            **family.write(config), "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
            "dtype": jnp.dtype(config.param_dtype).name}  # save_hf writes the tensors in it


def _shards(path: str) -> dict[str, list[str] | None]:
    """Each safetensors file of a checkpoint folder and the tensors the index's `weight_map`
    assigns to it (None: a single `model.safetensors`, every tensor it holds)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map each tensor name to its shard file")
        shards: dict[str, list[str] | None] = {}
        for key, name in weight_map.items():
            _check_inside(path, name, f"{index}: weight_map entry {key!r}")
            shards.setdefault(name, []).append(key)
        for name in shards:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{os.path.join(path, name)}: missing; {index} lists it")
        return dict(sorted(shards.items()))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        _check_inside(path, "model.safetensors", os.path.join(path, "model.safetensors"))
        return {"model.safetensors": None}
    raise FileNotFoundError(f"path: no model.safetensors or model.safetensors.index.json in {path}")


def _read_tensors(path: str) -> Iterator[tuple[str, np.ndarray, Callable[[], None]]]:
    """`(name, tensor, release)` for every tensor of a checkpoint folder, shard by shard, each a
    read-only view of the memory-mapped shard in its stored dtype (`SafetensorsFile`): no
    tensor is copied before `load_hf` casts and lays it out. `release()` drops the pages read
    from it from the process's memory once the caller is done with it (`SafetensorsFile.release`)."""
    index = os.path.join(path, "model.safetensors.index.json")
    for name, keys in _shards(path).items():
        shard = SafetensorsFile(os.path.join(path, name))
        absent = sorted(set(keys or ()) - shard.keys)
        if absent:
            more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
            raise ValueError(f"{index}: weight_map puts {absent[0]!r}{more} in {name}, but {shard.file} does not "
                             "hold it")
        for key in keys or sorted(shard.keys):
            yield key, shard.tensor(key), functools.partial(shard.release, key)
        del shard  # unmapped once the last view of it is dropped


def _shipped_tensors(path: str, shipped, dtype) -> Iterator[tuple[str, np.ndarray | QArray]]:
    """`_read_tensors`, each matrix a checkpoint ships quantized (`shipped_quantization`) given as one
    `QArray` under the name its dequantized checkpoint holds it by (MXFP4's `X_blocks` and `X_scales`
    as `X`, FP8's `X.weight` and `X.weight_scale_inv` as `X.weight`), its scales in `dtype`.

    Raises:
      ValueError: a matrix's part without the other.
    """
    method, block = shipped or (None, None)
    pending: dict[str, dict[str, np.ndarray]] = {}  # a matrix's first part read, until its other is
    releases: dict[str, list] = {}
    for key, w, release in _read_tensors(path):
        if method == "mxfp4" and key.endswith(("_blocks", "_scales")):
            name, part = key.rsplit("_", 1)
        elif method == "fp8" and (key.endswith(".weight_scale_inv") or w.dtype == ml_dtypes.float8_e4m3fn):
            name, part = key.removesuffix("_scale_inv"), "scales" if key.endswith("_scale_inv") else "blocks"
        else:
            yield key, w
            release()  # the caller has made its copy: the mapped pages need not stay resident
            continue
        parts = pending.setdefault(name, {})
        parts[part] = w
        releases.setdefault(name, []).append(release)
        if len(parts) == 2:
            del pending[name]
            yield name, (from_mxfp4(parts["blocks"], parts["scales"], dtype) if method == "mxfp4"
                         else from_fp8(parts["blocks"], parts["scales"], block, dtype))
            for release in releases.pop(name):  # both parts' pages, once the matrix is made from them
                release()
    if pending:
        name, parts = next(iter(pending.items()))
        raise ValueError(f"{path}: {name}: {'its scales' if 'blocks' in parts else 'its values'} are missing "
                         f"(a {method} matrix ships as two tensors)")


def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary, which is what XLA's
    CPU client needs to take a numpy array as its own buffer instead of copying it."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _placed(w: np.ndarray, dtype, sharding=None) -> jax.Array:
    """`w` as a jax array of `dtype`, made with a single copy that is cast and laid out at once.

    On a CPU, `jax.device_put` takes the aligned array as its buffer: the copy made here is
    the parameter, and loading holds no second one of any tensor
    (tests/convert/test_load_memory.py measures it). On an accelerator it is copied to the
    device, and freed once there. With a `sharding`, each device's block is cut from `w` and
    cast on its own: no device ever holds more of the tensor than its block."""
    if sharding is not None:
        return jax.make_array_from_callback(w.shape, sharding, lambda index: np.asarray(w[index], dtype))
    out = _aligned_empty(w.shape, dtype)
    np.copyto(out, w, casting="unsafe")  # bfloat16 to float32 is exact; float32 to bfloat16 rounds to nearest even
    return jax.device_put(out)


def _as_param(w: np.ndarray, dtype) -> jax.Array:
    """A tensor about to be quantized, as its parameter dtype holds it: as stored where that dtype holds
    it exactly (bfloat16 for float32 parameters; the quantizer widens it inside its program, where no
    float32 copy of the whole tensor is made: 1 GB for the 1B shape's embedding), else rounded to it."""
    return jnp.asarray(w) if jnp.promote_types(w.dtype, dtype) == jnp.dtype(dtype) else jnp.asarray(w, dtype)


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


def load_hf_config(path: str, *, max_seq_len: int | None = None, dtype=jnp.float32, param_dtype=None
                   ) -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face checkpoint folder, from its `config.json` alone:
    what a command checks its flags against before it reads any weight. The arguments are
    `load_hf`'s.

    Raises:
      FileNotFoundError: `path` or its `config.json` does not exist.
      ValueError: `path` is a file, or its `config.json` is malformed (naming the field).
    """
    return _config_of(path, _config_json(path), max_seq_len=max_seq_len, dtype=dtype, param_dtype=param_dtype)


def _config_json(path: str) -> dict:
    """A checkpoint folder's `config.json`, parsed (a FileNotFoundError or ValueError that says why not)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint folder holding config.json and model.safetensors "
                         f"(got the file {path!r})")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: missing; a Hugging Face checkpoint folder holds config.json")
    return read_json_object(config_path, "a model config (a JSON object)")


def _config_of(path: str, hf: dict, **options) -> DecoderConfig:
    """`config_from_hf(hf, **options)`, its errors naming the folder `path` too."""
    try:
        return config_from_hf(hf, **options)
    except ValueError as e:  # say which checkpoint; the message names the field
        raise ValueError(f"{path}: {e}") from None


def load_hf(path: str, *, max_seq_len: int | None = None, dtype=jnp.float32, param_dtype=None,
            scan_layers: bool = False, shardings=None, quantize: str | Quantization | None = None):
    """Loads a Hugging Face checkpoint folder of one of `jaxformer.families.FAMILIES`.

    Args:
      path: a folder as `save_pretrained` writes it: `config.json`, `model.safetensors` or
        shards with `model.safetensors.index.json`, in any floating dtype (bfloat16 as shipped).
      max_seq_len: longest sequence the model accepts; default `max_position_embeddings`.
      dtype: compute dtype of the returned config.
      param_dtype: dtype the parameters are read into, tensor by tensor; None: `dtype`
        (`dtype=jnp.bfloat16` keeps a bfloat16 checkpoint's weights as they are).
      scan_layers: return the scanned form (`DecoderConfig.scan_layers`), each layer read
        straight into its row of the stacked parameters.
      shardings: a tree of `jax.sharding.Sharding` shaped like the returned parameters (as
        `jaxformer.sharding.tree_shardings` makes for the model), or None for the default
        device. Each tensor is placed in its sharding as it is read, so the model is never
        whole on one device first (a model larger than one device's memory loads onto a mesh).
        A quantized matrix's entry (`quantize`, or a checkpoint that ships quantized) may be its
        float matrix's sharding, as `tree_shardings` gives for the float model's shapes, or a
        `QArray` of shardings, as it gives for the quantized model's; from the former each matrix
        takes `jaxformer.sharding.quantized_shardings`: its values split as the float matrix,
        its scales too where they divide.
      quantize: "int8", "int4" or "nf4" (or a `jaxformer.quantized.Quantization` for a group size
        or int4's zero point): each of the model's matrices (`quantized.MATRICES`; not the
        embedding, the head, norms or routers) quantized as it is read, tensor by tensor, so that
        loading holds the quantized model and one float tensor at most; its scales in
        `param_dtype`. Each matrix is quantized on the default device, then placed in its
        sharding (a stacked one's rows are gathered on the host first). None: as stored.

    Returns:
      `(config, params)`: a `DecoderConfig` (its `hf_model_type` the family) and the
      parameter tree for `Decoder(config)`.

    Raises:
      FileNotFoundError: `path`, its `config.json` or its weights do not exist.
      ValueError: naming the file and what is wrong with it (docs/parity.md lists what is refused).
    """
    hf = _config_json(path)
    config = _config_of(path, hf, max_seq_len=max_seq_len, dtype=dtype, param_dtype=param_dtype)
    family = family_of(config)
    how = Quantization(quantize) if isinstance(quantize, str) else quantize
    shipped = shipped_quantization(text_model(hf))
    # Each matrix's input axes (path -> axes), where any is quantized: on load (its groups checked
    # against every matrix before a tensor is read), or as the checkpoint ships them.
    inputs = _matrix_inputs(config, scan_layers, how) if how is not None or shipped is not None else {}
    outer_type = hf.get("model_type")
    image_text, other_towers = outer_type in TEXT_MODELS, {}
    table: dict[str, list[Tensor]] = {}
    for t in family.tensors(config):
        table.setdefault(t.hf_key, []).append(t)
    params: dict = {}
    # scan_layers: layer i's tensor is copied into its row of its stacked parameter (`blocks/.../w[i]`
    # in a uniform model: `scanned_places`), allocated whole at the first layer; stacking the
    # per-layer arrays afterwards would hold the weights twice.
    places = {block_name(i): place for i, place in enumerate(scanned_places(layer_specs(config)))} \
        if scan_layers else {}
    # (Likewise an expert's tensor into its row of the experts' stack, `.../mlp/w_up[e]`, and in a
    # scanned model `blocks/mlp/w_up[i, e]`.)
    stacks: dict[tuple[str, ...], tuple[np.ndarray, list[tuple]]] = {}  # stacked path -> (array, rows written)
    stored_head, seen, unexpected = None, set(), []
    for key, w in _shipped_tensors(path, shipped, config.param_dtype):
        if key.endswith("rotary_emb.inv_freq"):  # older checkpoints store them; they follow from rope_theta
            continue
        if not isinstance(w, QArray) and w.dtype.name in ("uint8", "float8_e4m3fn"):
            raise ValueError(f"{path}: {key}: stored as {w.dtype.name}, a quantized matrix's part, but config.json's "
                             "quantization_config does not ship one by that name (it needs dequantizing, not a cast)")
        if image_text and key.startswith(TEXT_PREFIX):  # the text model's, named as its family names them
            key = "model." + key[len(TEXT_PREFIX):]
        elif image_text and key != "lm_head.weight":  # another tower's (`model.visual.`, `model.audio_tower.`, ...)
            tower = ".".join(key.split(".")[:2]) + "."
            other_towers[tower] = other_towers.get(tower, 0) + 1
            continue
        if key == "lm_head.weight" and config.tie_embeddings:  # some tied checkpoints store the head anyway
            stored_head = w
            continue
        if key not in table and family.ignored is not None and family.ignored(config, key):
            continue  # (a part of the checkpoint the family reads past, as its docstring says)
        if key not in table:
            unexpected.append(key)
            continue
        parts = table[key]
        want = whole_shape(parts)
        if w.shape != want:
            raise ValueError(f"{path}: {key}: expected shape {want} from config.json, got {tuple(w.shape)}")
        for t in parts:
            value = t.to_jax(w[t.index])
            lead, shape, where = (), t.shape, t.path  # its index in a stacked parameter, that one's shape and path
            if t.expert is not None:  # one expert's row of the experts' stack
                lead, shape = (t.expert[0],), (t.expert[1], *t.shape)
            if t.path[0] in places:  # its layer's row of a scanned stack
                stacked_path, row, rows = places[t.path[0]]
                lead, shape, where = (row, *lead), (rows, *shape), (*stacked_path, *t.path[1:])
            if isinstance(value, QArray) or (how is not None and where in inputs):  # as shipped, or quantized
                # as read (the float tensor lives no longer than this)
                row_inputs = tuple(i - len(lead) for i in inputs[where])  # (a row's: without the stack's axes)
                row = stored(value, row_inputs) if isinstance(value, QArray) else quantize_matrix(
                    _as_param(value, config.param_dtype), how, row_inputs, config.param_dtype)
                jax.block_until_ready(row)  # (jax runs it asynchronously: a loop that ran ahead would hold
                # several tensors in flight, not one)
                if not lead:
                    _set(params, where, row if shardings is None else put(row, _sharding(shardings, where, row)))
                    continue
                rows = shape[:len(lead)]  # the stack's leading axes: its layers, its experts
                stacked, filled = stacks.setdefault(where, (jax.tree.map(
                    lambda leaf, rows=rows: np.empty((*rows, *leaf.shape), leaf.dtype), row), []))
                for buffer, leaf in zip(jax.tree.leaves(stacked), jax.tree.leaves(row)):
                    buffer[lead] = np.asarray(leaf)
                filled.append(lead)
                continue
            if not lead:
                _set(params, where, _placed(value, config.param_dtype,
                                            None if shardings is None else _get(shardings, where)))
                continue
            stacked, filled = stacks.setdefault(where, (_aligned_empty(shape, config.param_dtype), []))
            np.copyto(stacked[lead], value, casting="unsafe")
            filled.append(lead)
        seen.add(key)
    missing = sorted(table.keys() - seen)
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match config.json: missing {missing}, "
                         f"unexpected {sorted(unexpected)}")
    embed = params.get("embed")
    if isinstance(embed, QArray) and stored_head is not None:  # the embedding quantized as read: the stored
        # head is quantized alike and compared (a head equal to the embedding quantizes to the same leaves)
        stored_head = quantize_matrix(jnp.asarray(stored_head, config.param_dtype), how, (1,), config.param_dtype)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stored_head), jax.tree.leaves(embed)))
    else:
        same = stored_head is None or np.array_equal(stored_head.astype(config.param_dtype), embed)
    if not same:
        raise ValueError(f"{path}: config.json tie_word_embeddings: is true but lm_head.weight differs from "
                         "model.embed_tokens.weight")
    if other_towers:  # (one line: what of an image-text checkpoint is left)
        logging.getLogger(__name__).warning(
            f"{path}: not read (jaxformer runs the text model alone): "
            + ", ".join(f"{n} tensors under {tower}" for tower, n in sorted(other_towers.items())))
    for where, (stacked, filled) in stacks.items():
        if sorted(filled) != list(np.ndindex(stacked.shape[:len(filled[0])])):  # a row never written would be garbage
            raise ValueError(f"{path}: {'/'.join(where)} is not in every layer or expert it stacks, so they cannot "
                             "stack")
        _set(params, where, jax.device_put(stacked) if shardings is None else put(stacked, _sharding(
            shardings, where, stacked)))
    return (config.replace(scan_layers=True) if scan_layers else config), params


def _matrix_inputs(config: DecoderConfig, scan_layers: bool, how: Quantization | None
                   ) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Each of the model's matrices that may be quantized (`quantized.MATRICES`: its path in the
    tree `load_hf` returns) and the axes its products sum over (`quantized.input_axes`, counted in
    the whole stacked parameter).

    Raises:
      ValueError: `how`'s group does not divide a matrix's inputs (before any tensor is read).
    """
    model = Decoder(config.replace(scan_layers=True) if scan_layers else config)
    found = {}
    for path, axes in jax.tree_util.tree_flatten_with_path(param_axes(model), is_leaf=lambda x: isinstance(x, tuple)
                                                           )[0]:
        where = tuple(key.key for key in path)
        axes_in = input_axes(where[-1], axes, how is not None and how.head)
        if axes_in is not None:
            found[where] = axes_in
    shapes = {tuple(key.key for key in path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda: model.init(jax.random.key(0), *model.init_inputs())["params"]))[0]}
    for where, axes_in in found.items():  # (a group that does not tile a matrix: refused here, not midway)
        if how is not None:
            check_group(shapes[where], axes_in, how)
    return found


# The `quantization_config` of a folder `save_hf` writes as shipped: gpt-oss's (MXFP4: its experts alone;
# the modules transformers leaves as they are named) and DeepSeek-V3's (FP8 in 128 x 128 blocks).
SHIPPED_CONFIGS = {
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
# The matrices (by parameter name) a folder written as shipped holds in each format, all of them:
# transformers reads every gpt-oss feed-forward (its experts) of an MXFP4 folder as MXFP4, and every
# linear layer but the head of an FP8 folder as FP8.
SHIPPED_MATRICES = {"mxfp4": {"w_gate", "w_up", "w_down"}, "fp8": MATRICES}


def save_hf(config: DecoderConfig, params, path: str, *, bos_id: int | None = None,
            eos_id: int | list[int] | None = None, pad_id: int | None = None, dequantize: bool = False) -> None:
    """Writes a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads, in
    the format of the config's family (`hf_model_type`; None: Llama, or Qwen2 with q/k/v
    biases). An interleaved-RoPE model is saved permuted to split-half, the only pairing
    transformers implements for most families (DeepSeek's keep theirs: `Family.pairings`);
    Phi-3's fused projections are fused again.

    A quantized model (`jaxformer.quantized`) is written as shipped where its matrices are as a
    shipped checkpoint holds them, which is how transformers reads such a folder
    (`SHIPPED_MATRICES`): every quantized matrix MXFP4, the feed-forwards all of them (gpt-oss's
    experts: `X_blocks`, `X_scales`), or every matrix FP8 (`X.weight` float8 e4m3 and
    `X.weight_scale_inv` per 128 x 128 block); `config.json` then holds those checkpoints'
    `quantization_config` (`SHIPPED_CONFIGS`). The values and scales are written as held, so a
    folder `load_hf` read is written back bit for bit; a matrix split or fused on the way in
    (gpt-oss's `gate_up_proj`, a projection split into heads) is put together again exactly. Any
    other quantized model (int8, int4 or NF4 anywhere, both shipped formats, a float matrix among
    those: an adapter merged into one) is written dequantized to the parameter dtype, which
    transformers opens as a float checkpoint.

    Args:
      config: the `DecoderConfig` (either `scan_layers` form).
      params: the `Decoder` parameter tree.
      path: the folder (created if needed); each file in it is replaced atomically.
      bos_id, eos_id, pad_id: the tokenizer's special ids (`eos_id` may list several), for
        `config.json` and `generation_config.json`, where readers find the stop ids.
      dequantize: write every quantized matrix dequantized, MXFP4 and FP8 too.

    Raises:
      ValueError: the config has a feature its family's format cannot hold, or `params` is
        not its tree, or an MXFP4 or FP8 matrix's scales are not one per block of its format
        (`quantized.to_mxfp4`, `to_fp8`; the folder's files left as they were: write it with
        `dequantize=True`).
      OSError: naming the file, when the folder cannot be written (a full disk).
    """
    config, params = with_scan_layers(config, params, False)  # the checkpoint names each layer
    pairings = family_of(config).pairings  # (the format's own: transformers' split-half, DeepSeek's interleaved too)
    config, params = with_rope_pairing(config, params, config.rope_pairing if config.rope_pairing in pairings
                                       else pairings[0])
    special = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    hf_config = config_to_hf(config, **special)  # refuses what the format cannot hold, before any file is written
    dtype = np.dtype(config.param_dtype)
    parts: dict[str, list] = {}  # HF key -> its parts (Phi-3's fused projections: several)
    for t in family_of(config).tensors(config):
        shape, want = tuple(_get(params, t.path).shape), t.shape if t.expert is None else (t.expert[1], *t.shape)
        if shape != want:
            raise ValueError(f"params{''.join(f'[{p!r}]' for p in t.path)}: expected shape {want}, got {shape}")
        parts.setdefault(t.hf_key, []).append(t)
    shipped = None if dequantize else _shipped_format(params)
    if shipped is not None:
        hf_config["quantization_config"] = SHIPPED_CONFIGS[shipped]
    block = tuple(SHIPPED_CONFIGS["fp8"]["weight_block_size"])
    as_shipped = {key for key, pieces in parts.items() if shipped is not None
                  and all(isinstance(_get(params, t.path), QArray) for t in pieces)}

    def whole(key: str, part, part_dtype) -> np.ndarray:  # checkpoint tensor `key`, each part's `part(w)` in place
        out = np.empty(whole_shape(parts[key]), part_dtype)
        for t in parts[key]:
            w = _get(params, t.path) if t.expert is None else _get(params, t.path)[t.expert[0]]
            out[t.index] = t.to_hf(part(w))
        return out

    def dequantized(w) -> np.ndarray:  # (a quantized matrix written dequantized)
        return np.asarray(dequantize_matrix(w, jnp.float32) if isinstance(w, QArray) else w).astype(dtype)

    def files(key: str) -> list[tuple[str, tuple[int, ...], np.dtype]]:  # the tensors `key` is written as
        shape = whole_shape(parts[key])
        if key not in as_shipped:
            return [(key, shape, dtype)]
        if shipped == "mxfp4":  # `to_mxfp4`'s [..., out, in / 32, 16] bytes and [..., out, in / 32] exponents
            *lead, n_in, n_out = shape
            return [(f"{key}_blocks", (*lead, n_out, n_in // 32, 16), np.dtype(np.uint8)),
                    (f"{key}_scales", (*lead, n_out, n_in // 32), np.dtype(np.uint8))]
        return [(key, shape, np.dtype(ml_dtypes.float8_e4m3fn)),  # `to_fp8`'s values and a scale per block
                (f"{key}_scale_inv", tuple(-(-n // b) for n, b in zip(shape, block)), np.dtype(np.float32))]

    written = {name: key for key in parts for name, _, _ in files(key)}  # each file tensor's checkpoint tensor
    second: dict[str, np.ndarray] = {}  # a shipped matrix's scales, made with its values and asked for next

    def hf_tensor(name: str) -> np.ndarray:  # one tensor at a time
        key = written[name]
        if key not in as_shipped:
            return whole(key, dequantized, dtype)
        if name in second:
            return second.pop(name)
        # The checkpoint's matrix: its values, and each value's scale (`full_scale`: parts' tiles may differ)
        first = _get(params, parts[key][0].path)
        matrix = QArray(whole(key, lambda w: np.asarray(_logical(w).qvalue), first.qvalue.dtype),
                        whole(key, lambda w: full_scale(_logical(w)), first.scale.dtype), qtype=first.qtype)
        try:
            values, scales = to_mxfp4(matrix) if shipped == "mxfp4" else to_fp8(matrix, block)
        except ValueError as e:  # (its scales are not its format's: it cannot be written exactly as shipped)
            raise ValueError(f"{key}: {e}; save_hf(dequantize=True) writes it dequantized") from None
        second[files(key)[1][0]] = scales
        return values

    shapes = [entry for key in parts for entry in files(key)]
    os.makedirs(path, exist_ok=True)
    write_atomically(os.path.join(path, "model.safetensors"),
                     lambda tmp: write_safetensors(tmp, shapes, hf_tensor, {"format": "pt"}))
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    write_text_atomically(os.path.join(path, "generation_config.json"), json.dumps(generation, indent=2))
    write_text_atomically(os.path.join(path, "config.json"), json.dumps(hf_config, indent=2))


def _logical(w: QArray) -> QArray:
    """A quantized matrix in the model's layout (a parameter tree's `Quantized` holds its inputs last)."""
    return w.logical() if isinstance(w, Quantized) else w


def _shipped_format(params) -> str | None:
    """The format `save_hf` writes a model's quantized matrices in as shipped (`SHIPPED_CONFIGS`): the one
    every quantized matrix holds, where every matrix of the kinds its checkpoints hold in it
    (`SHIPPED_MATRICES`) is quantized; None: none, the model written dequantized."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QArray))[0]
    formats = {format_of(w) for _, w in leaves if isinstance(w, QArray)}
    if len(formats) != 1 or formats.isdisjoint(SHIPPED_CONFIGS):
        return None
    shipped = formats.pop()
    whole = all(isinstance(w, QArray) for path, w in leaves if path[-1].key in SHIPPED_MATRICES[shipped])
    return shipped if whole else None


def _sharding(shardings, where: tuple[str, ...], value):
    """`shardings`' entry for the parameter at `where`; for a quantized matrix given as its float
    matrix's sharding, the `QArray` of shardings that follows from it (`quantized_shardings`)."""
    sharding = _get(shardings, where)
    if isinstance(value, QArray) and isinstance(sharding, jax.sharding.Sharding):
        return quantized_shardings(sharding, value)
    return sharding


def _get(tree, path: tuple[str, ...]):
    for depth, name in enumerate(path):
        if not isinstance(tree, dict) or name not in tree:
            raise ValueError(f"params has no {'/'.join(path[:depth + 1])}: not a Decoder(config) parameter tree")
        tree = tree[name]
    return tree
