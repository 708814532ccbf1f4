"""The numbers each family's tiny model gives, recorded so that a change to how the decoder is
built (its layers, their kinds, the scan) can be checked to leave every number as it was.

For each tiny shipped config (`shipped.tiny`) with weights drawn here far from ties, this
records the float32 logits (layer by layer and scanned), the bfloat16 logits, greedy tokens
through the KV cache, and a training step: the loss before it, after one Adam update, and
with LoRA adapters on every matrix. `tests/families/test_goldens.py` recomputes them.

    python tests/families/goldens.py      # rewrites goldens.npz: only when a change is MEANT to move them
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILE = HERE / "goldens.npz"
FINGERPRINT = HERE / "goldens.json"

if __name__ == "__main__":  # the settings the suite runs under (tests/conftest.py), applied before jax starts
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import conftest  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from shipped import tiny  # noqa: E402

from jaxformer import Decoder, LoraConfig, generate, init_lora, label_smoothed_cross_entropy  # noqa: E402
from jaxformer.convert import config_from_hf, with_scan_layers  # noqa: E402
from jaxformer.kernels import cpu  # noqa: E402

# The families' tiny checkpoints, as tests/families/test_families.py builds them (its OVERRIDES and VARIANTS).
FAMILIES = {
    "Llama-3.2-1B": ("Llama-3.2-1B", {}),
    "Qwen3-0.6B": ("Qwen3-0.6B", {}),
    "Mistral-7B-v0.1": ("Mistral-7B-v0.1", {}),
    "gemma-2b": ("gemma-2b", {}),
    "gemma-2-2b": ("gemma-2-2b", dict(query_pre_attn_scalar=24, final_logit_softcapping=3.0)),
    "gemma-3-1b-it": ("gemma-3-1b-it", dict(query_pre_attn_scalar=24)),
    "Phi-3-mini-4k-instruct": ("Phi-3-mini-4k-instruct", {}),
    "Phi-3 longrope": ("Phi-3-mini-4k-instruct", dict(
        max_position_embeddings=64, original_max_position_embeddings=16, sliding_window=None,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                      "long_factor": [1.0 + 2.5 * i for i in range(8)]})),
    "Qwen2.5-0.5B": ("Qwen2.5-0.5B", {}),
    "SmolLM2-135M": ("SmolLM2-135M", {}),
}
MAX_SEQ_LEN = 64
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"))


def config_of(name: str):
    base, overrides = FAMILIES[name]
    return config_from_hf(tiny(base, **overrides), max_seq_len=MAX_SEQ_LEN)


def weights(config, seed: int = 0) -> dict:
    """The model's parameters redrawn far from ties (as `shipped.scaled_up` does transformers'):
    matrices at std 0.25, norm weights around their identity (Gemma's, `1 + w`, around 0)."""
    shapes = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = []
    for (path, leaf), key in zip(leaves, keys):
        name = str(path[-1].key)
        noise = jax.random.normal(key, leaf.shape, jnp.float32)
        if "norm" in name or "norm" in str(path[-2].key if len(path) > 1 else ""):
            drawn.append(0.5 * noise + (0.0 if config.norm_plus_one else 1.0))
        elif name == "embed" and config.embed_scale:
            drawn.append(0.4 / config.d_model ** 0.5 * noise)
        else:
            drawn.append(0.25 * noise)
    return jax.tree_util.tree_unflatten(tree, drawn)


def numbers(name: str) -> dict[str, np.ndarray]:
    """Every recorded number of family `name`, by key `name/what`."""
    config = config_of(name)
    params = weights(config)
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, config.vocab_size)  # longer than the window (8)
    out = {}
    logits = jax.jit(lambda p, t: Decoder(config).apply({"params": p}, t)[0])(params, tokens)
    out["logits"] = logits
    scanned_config, scanned_params = with_scan_layers(config, params, True)
    out["scanned_logits"] = jax.jit(lambda p, t: Decoder(scanned_config).apply({"params": p}, t)[0])(
        scanned_params, tokens)
    bf16 = config.replace(dtype=jnp.bfloat16)
    out["bfloat16_logits"] = jax.jit(lambda p, t: Decoder(bf16).apply({"params": p}, t)[0])(params, tokens)
    prompt = tokens[:, :12]
    new = 16 if config.rope_scaling is None or config.rope_scaling.kind != "longrope" else 5
    out["greedy"] = generate(Decoder(config), params, prompt, max_new_tokens=new)

    def loss(p, model_config, variables_of):
        logits, _ = Decoder(model_config).apply(variables_of(p), tokens[:, :-1])
        return label_smoothed_cross_entropy(logits, tokens[:, 1:], 0.1)

    optimizer = optax.adam(1e-2)

    def one_step(model_config, variables_of, p):
        value, grads = jax.value_and_grad(loss)(p, model_config, variables_of)
        updates, _ = optimizer.update(grads, optimizer.init(p), p)
        return value, loss(optax.apply_updates(p, updates), model_config, variables_of)

    for key, model_config, variables_of, trained in (
            ("train", config, lambda p: {"params": p}, params),
            ("scanned_train", scanned_config, lambda p: {"params": p}, scanned_params)):
        out[f"{key}_loss"], out[f"{key}_loss_after"] = jax.jit(
            lambda p, c=model_config, v=variables_of: one_step(c, v, p))(trained)
    lora_config = config.replace(lora=LORA)
    adapters = jax.tree.map(lambda x: x + 0.1, init_lora(params, LORA, jax.random.key(3)))  # b != 0: adapters count
    out["lora_loss"], out["lora_loss_after"] = jax.jit(lambda a: one_step(
        lora_config, lambda a_: {"params": params, "lora": a_}, a))(adapters)
    return {f"{name}/{key}": np.asarray(value) for key, value in out.items()}


def fingerprint() -> dict:
    """What bitwise equality depends on besides the code: the compiler and the CPU it targets."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma"))))
                break
    return {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "machine": platform.machine(),
            "cpu_flags": flags, "backend": jax.default_backend(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "most_optimizations_disabled": os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", ""),
            "cpu_products": cpu.enabled()}  # (jaxformer.kernels.cpu: their sums' order, or XLA's)


if __name__ == "__main__":
    recorded = {}
    for family in FAMILIES:
        recorded.update(numbers(family))
        print(family, "recorded", flush=True)
    np.savez_compressed(FILE, **recorded)
    FINGERPRINT.write_text(json.dumps(fingerprint(), indent=1) + "\n")
    print(f"wrote {FILE} ({FILE.stat().st_size} bytes) and {FINGERPRINT}")
