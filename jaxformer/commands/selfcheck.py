"""`jaxformer-selfcheck`: the correctness checks a from-scratch Transformer needs, on this backend.

These are the checks that catch the bugs a from-scratch Transformer really has:
information leaking backwards, a cache that drifts from the full forward, RoPE that
is not relative, kv heads grouped the wrong way, a norm that centres, an init that is
not near uniform. Each prints its figure; the exit code is non-zero if any fails.
The test suite runs the same checks (tests/commands/test_selfcheck.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer.attention import dot_product_attention
from jaxformer.cache import KVCache
from jaxformer.config import DecoderConfig
from jaxformer.decoder import Decoder
from jaxformer.decoding import generate
from jaxformer.norms import RMSNorm
from jaxformer.positions import apply_rope, rope_cos_sin, rope_inv_freq

# A small decoder: 3 layers, 4 query heads sharing 2 kv heads, d_model 64.
CONFIG = DecoderConfig(vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    figure: str


@functools.lru_cache(maxsize=None)
def _model_and_params(config: DecoderConfig = CONFIG, seed: int = 0):
    """`(apply, params)`: the model's jitted apply (one compile per input shape instead
    of one per operation, shared by the checks) and its freshly initialised parameters."""
    model = Decoder(config)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32))["params"]
    return jax.jit(model.apply), params


def _random_tokens(seed: int, shape: tuple[int, int], vocab_size: int = CONFIG.vocab_size) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab_size)


def check_causality() -> CheckResult:
    """Changing token 9 of 16 must leave logits at positions < 9 exactly unchanged."""
    apply, params = _model_and_params()
    tokens = _random_tokens(1, (2, 16))
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % CONFIG.vocab_size)
    base, _ = apply({"params": params}, tokens)
    pert, _ = apply({"params": params}, changed)
    past = float(jnp.abs(base[:, :9] - pert[:, :9]).max())
    future = float(jnp.abs(base[:, 9:] - pert[:, 9:]).max())
    # future > 1e-4 proves the perturbation did something: otherwise past == 0 is vacuous.
    return CheckResult("causality", past == 0.0 and future > 1e-4,
                       f"past delta {past:.2e} | future delta {future:.2e}")


def check_kv_cache() -> CheckResult:
    """Prefill 5 tokens, then 7 single steps: the logits of one full forward, every row at pos 12."""
    apply, params = _model_and_params()
    tokens = _random_tokens(2, (2, 12))
    full, _ = apply({"params": params}, tokens)
    cache = KVCache.create(CONFIG, batch_size=2)
    logits, cache = apply({"params": params}, tokens[:, :5], cache)
    pieces = [logits]
    for t in range(5, 12):
        logits, cache = apply({"params": params}, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    err = float(jnp.abs(full - jnp.concatenate(pieces, axis=1)).max())
    pos = cache.pos.tolist()  # one position per row
    return CheckResult("kv cache", err < 1e-5 and pos == [12, 12],
                       f"max |full - incremental| = {err:.2e}, pos = {pos}")


def check_rope_relative() -> CheckResult:
    """<RoPE(q, i), RoPE(k, j)> depends only on i - j; position 0 is the identity."""
    head_dim = 32
    cos, sin = rope_cos_sin(jnp.arange(64), rope_inv_freq(head_dim, 10000.0))  # [64, head_dim/2]
    q, k = jax.random.normal(jax.random.key(3), (2, 1, 1, 1, head_dim))  # [batch, seq, heads, head_dim] each
    ok, figures = True, []
    for pairing in ("split_half", "interleaved"):
        def score(i, j, pairing=pairing):
            qi = apply_rope(q, cos[i:i + 1], sin[i:i + 1], pairing)
            kj = apply_rope(k, cos[j:j + 1], sin[j:j + 1], pairing)
            return float(jnp.sum(qi * kj))

        a, b, c = score(5, 2), score(20, 17), score(20, 10)  # offsets 3, 3, 10
        identity = float(jnp.abs(apply_rope(q, cos[:1], sin[:1], pairing) - q).max())
        ok &= abs(a - b) < 1e-4 and abs(a - c) > 1e-3 and identity < 1e-6
        figures.append(f"{pairing}: score(5,2)={a:+.4f} score(20,17)={b:+.4f} score(20,10)={c:+.4f}")
    return CheckResult("rope relative", ok, "; ".join(figures))


def check_gqa_grouping() -> CheckResult:
    """Query heads 2h and 2h+1 read kv head h, and the cache holds only the kv heads."""
    apply, params = _model_and_params()
    n_head, n_kv, head_dim = CONFIG.n_head, CONFIG.n_kv_head, CONFIG.head_dim
    q = jax.random.normal(jax.random.key(4), (1, 3, n_head, head_dim))
    k = jax.random.normal(jax.random.key(5), (1, 3, n_kv, head_dim))
    # Value of kv head h is the constant h, so every query head's output names its kv head.
    v = jnp.broadcast_to(jnp.arange(n_kv, dtype=jnp.float32)[:, None], (1, 3, n_kv, head_dim))
    out, _ = dot_product_attention(q, k, v, jnp.ones((3, 3), bool))
    read = np.asarray(out[0, :, :, 0].mean(0)).round(6)  # [n_head]
    want = np.arange(n_head) // (n_head // n_kv)
    wk = params["block_0"]["attn"]["wk"]
    wq = params["block_0"]["attn"]["wq"]
    kv_fraction = wk.size / wq.size
    ok = np.array_equal(read, want) and wk.shape[1] == n_kv and wq.shape[1] == n_head
    return CheckResult("gqa grouping", ok,
                       f"query heads read kv heads {read.astype(int).tolist()}, "
                       f"kv cache is {kv_fraction:.0%} of MHA")


def check_rmsnorm() -> CheckResult:
    """RMSNorm equals x / sqrt(mean(x^2) + eps) * weight and does not centre the mean."""
    norm = RMSNorm(CONFIG.norm_eps)
    x = jax.random.normal(jax.random.key(6), (4, 7, CONFIG.d_model)) * 3 + 1
    weight = jax.random.uniform(jax.random.key(7), (CONFIG.d_model,), minval=0.5, maxval=1.5)
    got = norm.apply({"params": {"weight": weight}}, x)
    want = x / jnp.sqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + CONFIG.norm_eps) * weight
    err = float(jnp.abs(got - want).max())
    mean = float(jnp.abs(got.mean(-1)).max())
    return CheckResult("rmsnorm", err < 1e-5 and mean > 1e-3,
                       f"max |got - formula| = {err:.2e}, |row mean| up to {mean:.3f} (not centred)")


def check_initial_loss() -> CheckResult:
    """A freshly initialised LM predicts near-uniformly: loss close to ln V."""
    apply, params = _model_and_params()
    tokens = _random_tokens(8, (8, 32))
    logits, _ = apply({"params": params}, tokens[:, :-1])
    loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())
    expected = math.log(CONFIG.vocab_size)
    return CheckResult("initial loss", abs(loss - expected) < 0.15,
                       f"{loss:.4f} vs ln(V) = {expected:.4f}")


def check_tying_and_shapes() -> CheckResult:
    """The tied head is the embedding (no matrix of its own); logits and generate shapes."""
    apply, params = _model_and_params()
    _, untied_params = _model_and_params(CONFIG.replace(tie_embeddings=False))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    n_untied = sum(p.size for p in jax.tree.leaves(untied_params))
    n_embed = params["embed"].size
    tokens = _random_tokens(9, (3, 11))
    logits, _ = apply({"params": params}, tokens)
    out = generate(Decoder(CONFIG), params, tokens, max_new_tokens=5)
    ok = ("lm_head" not in params and n_untied - n_params == n_embed
          and logits.shape == (3, 11, CONFIG.vocab_size) and out.shape == (3, 16))
    return CheckResult("tying & shapes", ok,
                       f"{n_params:,} params ({n_params - n_embed:,} non-embedding), "
                       f"logits {tuple(logits.shape)}, generate {tuple(out.shape)}")


CHECKS: tuple[Callable[[], CheckResult], ...] = (
    check_tying_and_shapes,
    check_initial_loss,
    check_rmsnorm,
    check_causality,
    check_kv_cache,
    check_rope_relative,
    check_gqa_grouping,
)


def main() -> int:
    device = jax.devices()[0]
    print(f"jaxformer selfcheck: jax {jax.__version__}, backend {jax.default_backend()} ({device.device_kind})")
    print(f"config: {CONFIG}\n")
    # float32 tolerances need float32 matmuls: GPUs default to TF32, TPUs to bf16 passes.
    with jax.default_matmul_precision("highest"):
        results = [check() for check in CHECKS]
    for r in results:
        print(f"  {r.name + ':':<16} {r.figure}  {'OK' if r.passed else 'FAILED'}")
    failed = [r.name for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
