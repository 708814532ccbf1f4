"""Gated DeltaNet: linear attention with a recurrent state (the linear layers of Qwen3-Next and Qwen3.5).

Each value head keeps a state `S [d_k, d_v]`, a memory from keys to values. Each token decays
it, corrects what it holds for the token's key, and is read from it by the token's query:

    S_t = exp(g_t) S_{t-1}                        # forget; g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T     # the delta rule: k_t's value moved toward v_t; beta_t = sigmoid(b_t)
    o_t = S_t^T q_t / sqrt(d_k)

q, k and v are a causal depthwise convolution (`kernel` taps, then SiLU) of their projections, and
q, k are L2-normalised; the output passes a gated RMSNorm, `norm(o) * silu(z)`, then the out
projection. Between calls a row keeps the convolution's last `kernel - 1` inputs and `S`: constant
in the length. `n_key_head` heads of q and k serve `n_value_head` of v (a multiple, r times):
value head h reads key head `h // r`, as transformers repeats them.

The recurrence has two forms, equal but for float32 rounding: `recurrent_delta_rule`, one scan
step per token (decoding); `chunked_delta_rule`, one step per chunk of C tokens, whose insides
are matrix products (prompts and training: time and memory linear in T).

Einsum letters: b batch, h value head, n chunk (or key head), i, j token in a chunk, k key
channel, v value channel, d model width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import FULL_WINDOW, Visibility
from jaxformer.lora import project
from jaxformer.sharding import CONV, EMBED, HEAD_DIM, HEADS, KV_HEADS, Weight, compute_param, param

_dot = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)  # every product here is float32 at least


def wide(dtype) -> jnp.dtype:
    """The dtype the layer computes in from inputs of `dtype`: float32, or float64 in a float64 model (whose
    results are then a float32 model's float64 twin, as the tests' error bounds take them)."""
    return jnp.promote_types(dtype, jnp.float32)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, float32 at least (transformers' `l2norm`, its eps)."""
    x = x.astype(wide(x.dtype))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def decay(a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """`g = -exp(A_log) * softplus(a + dt_bias)`, float32 (`wide`) `[batch, T, heads]` from `a` of the same
    shape and `a_log`, `dt_bias` `[heads]`: the log of each token's forget factor, <= 0."""
    dtype = wide(a.dtype)
    return -jnp.exp(a_log.astype(dtype)) * jax.nn.softplus(a.astype(dtype) + dt_bias.astype(dtype))


def short_convolution(x: jax.Array, weight: jax.Array, state: jax.Array, valid: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """`silu(y)` of the causal depthwise convolution `y_t = sum_j weight[j] * x_{t - K + 1 + j}` per
    channel, and the inputs kept for the next call.

    Args:
      x: `[batch, T, channels]`.
      weight: `[K, channels]`, the taps (torch's `conv1d.weight [channels, 1, K]` transposed).
      state: `[batch, K - 1, channels]`, the row's `K - 1` inputs before this call (zeros: none).
      valid: bool `[batch, T]`, False on a row's padding after its end (each row's valid tokens a prefix).

    Returns:
      `(silu(y) [batch, T, channels] in x's dtype, state [batch, K - 1, channels])`: the last `K - 1`
      valid inputs, the state's and this call's (padding changes nothing).
    """
    K, T = weight.shape[0], x.shape[1]
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [batch, K - 1 + T, channels]
    taps = weight.astype(wide(x.dtype))
    y = sum(window[:, j:j + T].astype(taps.dtype) * taps[j] for j in range(K))  # [batch, T, channels]
    if valid is None:
        return jax.nn.silu(y).astype(x.dtype), window[:, T:]
    kept = jnp.sum(valid, axis=1)  # [batch]: the window's last K - 1 up to the row's end, window[kept : kept + K - 1]
    state = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, K - 1))(window, kept)
    return jax.nn.silu(y).astype(x.dtype), state


def _per_value_head(q, k, v, g, beta, valid):
    """The rule's inputs in float32 (at least: `wide`) with q and k repeated to v's heads (head h reads key
    head h // r), q scaled by `1 / sqrt(d_k)`, and on padding (`valid` False) a decay of 1 (`g = 0`) and no write
    (`beta = 0`): such a token leaves the state as it was."""
    r, dtype = v.shape[2] // q.shape[2], wide(v.dtype)
    q, k = (jnp.repeat(x.astype(dtype), r, axis=2) for x in (q, k))  # [batch, T, heads, d_k]
    g, beta = g.astype(dtype), beta.astype(dtype)  # [batch, T, heads]
    if valid is not None:
        g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    return q * q.shape[-1] ** -0.5, k, v.astype(dtype), g, beta


def unit_lower_inverse(A: jax.Array) -> jax.Array:
    """`(I + A)^-1` for `A [..., C, C]` strictly lower-triangular, by doubling: a unit lower-triangular
    `[[L11, 0], [L21, L22]]` has the inverse `[[X11, 0], [-X22 L21 X11, X22]]`, so the inverses of the
    diagonal blocks of size s give those of size 2s, from s = 1 (the unit diagonal) up. Every block is
    the inverse of a leading piece of the system (bounded as the delta rule is), and the work is small
    matrix products (a CPU's batched triangular solve, LAPACK's per matrix, was ~40x slower here)."""
    C = A.shape[-1]
    P = 1 << (C - 1).bit_length()  # C padded to a power of two: rows of I below
    A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, P - C)] * 2)
    X = jnp.ones((*A.shape[:-2], P, 1, 1), A.dtype)  # [..., P / s, s, s]: the diagonal blocks' inverses, s = 1
    s = 1
    while s < P:
        n = P // (2 * s)  # blocks of size 2s
        L = jnp.diagonal(A.reshape(*A.shape[:-2], n, 2 * s, n, 2 * s), axis1=-4, axis2=-2)  # [..., 2s, 2s, n]
        L21 = jnp.moveaxis(L, -1, -3)[..., s:, :s]  # [..., n, s, s]: each one's block below its two of size s
        X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]  # [..., n, s, s]
        X21 = -_dot("...ij,...jk,...kl->...il", X22, L21, X11)
        X = jnp.concatenate([jnp.concatenate([X11, jnp.zeros_like(X11)], -1), jnp.concatenate([X21, X22], -1)], -2)
        s *= 2
    return X[..., 0, :C, :C]


def recurrent_delta_rule(q, k, v, g, beta, state, valid=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (module docstring's formula).

    Args:
      q, k: `[batch, T, n_key_head, d_k]` (L2-normalised by the caller).
      v: `[batch, T, heads, d_v]`, `heads` a multiple of `n_key_head`.
      g, beta: `[batch, T, heads]`, the log decay (<= 0) and the write strength.
      state: float32 `[batch, heads, d_k, d_v]`, S before the first token.
      valid: bool `[batch, T]` or None: False tokens change nothing.

    Returns:
      `(o [batch, T, heads, d_v], state)` float32, the state after the last token.
    """
    q, k, v, g, beta = _per_value_head(q, k, v, g, beta, valid)

    def step(S, token):  # S [batch, heads, d_k, d_v]
        q_t, k_t, v_t, g_t, beta_t = token  # [batch, heads, d_k] .. [batch, heads]
        S = S * jnp.exp(g_t)[..., None, None]
        delta = beta_t[..., None] * (v_t - _dot("bhkv,bhk->bhv", S, k_t))  # [batch, heads, d_v]: beta (v - S^T k)
        S = S + k_t[..., :, None] * delta[..., None, :]  # + k delta^T
        return S, _dot("bhkv,bhk->bhv", S, q_t)  # o_t = S^T q

    state, o = jax.lax.scan(step, state.astype(q.dtype), [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)])
    return jnp.moveaxis(o, 0, 1), state


def chunked_delta_rule(q, k, v, g, beta, state, valid=None, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule a chunk of C = min(chunk, T) tokens at a time: `recurrent_delta_rule`'s
    arguments and results, in a scan over the chunks.

    Within a chunk from state S_0, with `gamma_i = g_1 + ... + g_i` (token i's decay since the chunk's
    start), token i writes `k_i delta_i^T`, and unrolling the recurrence gives

        delta_i = beta_i (v_i - e^gamma_i S_0^T k_i - sum_{j<i} e^(gamma_i - gamma_j) (k_i . k_j) delta_j)
        o_i     = e^gamma_i S_0^T q_i + sum_{j<=i} e^(gamma_i - gamma_j) (q_i . k_j) delta_j
        S_C     = e^gamma_C S_0 + sum_j e^(gamma_C - gamma_j) k_j delta_j^T

    The first is a unit lower-triangular system, `(I + A) delta = beta v - beta e^gamma K S_0` with
    `A_ij = beta_i e^(gamma_i - gamma_j) k_i . k_j` (j < i), solved by `unit_lower_inverse`:
    `delta = u - w S_0`. Every exponent is <= 0. Each step of the scan is one chunk's whole work,
    rematerialised (`jax.checkpoint`): the backward pass keeps each chunk's S_0 alone and recomputes
    the chunk's `[C, C]` arrays, so memory is linear in T with a small constant (the arrays of every
    chunk at once cost ~3x the memory and, on a CPU, more time)."""
    q, k, v, g, beta = _per_value_head(q, k, v, g, beta, valid)
    batch, T, heads, _ = q.shape
    C = min(chunk, T)
    pad = -T % C  # tokens of g = beta = 0 that complete the last chunk: they change nothing

    def chunks(x):  # [batch, T, heads, ...] -> [n, batch, heads, C, ...]: the chunk axis first, for the scan
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, -1, C, *x.shape[2:]), (1, 3), (0, 2))

    seen = jnp.tril(jnp.ones((C, C), bool))  # [i, j]: j <= i

    @jax.checkpoint
    def step(S, each):  # S [batch, heads, d_k, d_v]: S_0 of this chunk; each [batch, heads, C, ...]
        q, k, v, g, beta = each
        gamma = jnp.cumsum(g, axis=-1)  # [batch, heads, C]
        decays = jnp.exp(jnp.where(seen, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))  # e^(gamma_i - gamma_j)
        k_beta = k * beta[..., None]
        A = _dot("bhik,bhjk->bhij", k_beta, k) * decays * (1 - jnp.eye(C, dtype=q.dtype))  # [batch, heads, C, C], j < i
        inverse = unit_lower_inverse(A)
        u = _dot("bhij,bhjv->bhiv", inverse, v * beta[..., None])  # [batch, heads, C, d_v]: delta were S_0 zero
        w = _dot("bhij,bhjk->bhik", inverse, k_beta * jnp.exp(gamma)[..., None])  # [..., C, d_k]: delta = u - w S_0
        delta = u - _dot("bhik,bhkv->bhiv", w, S)
        scores = _dot("bhik,bhjk->bhij", q, k) * decays  # e^(gamma_i - gamma_j) q_i . k_j
        o = _dot("bhik,bhkv->bhiv", q * jnp.exp(gamma)[..., None], S) + _dot("bhij,bhjv->bhiv", scores, delta)
        k_end = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]  # token j's write decayed to the chunk's end
        return jnp.exp(gamma[..., -1])[..., None, None] * S + _dot("bhjk,bhjv->bhkv", k_end, delta), o

    state, o = jax.lax.scan(step, state.astype(q.dtype), [chunks(x) for x in (q, k, v, g, beta)])
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(batch, -1, heads, o.shape[-1])  # [batch, n * C, heads, d_v]
    return o[:, :T], state


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`norm(x) * silu(z)` over the last axis: `x / sqrt(mean(x^2) + eps)`, cast to x's dtype, times
    `weight` as stored (ones at init: not `1 + weight`), times `silu(z)` in float32, cast to x's
    dtype (transformers' `Qwen3NextRMSNormGated`, in its order)."""
    dtype = wide(x.dtype)
    x32 = x.astype(dtype)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return ((weight.astype(x.dtype) * normed).astype(dtype) * jax.nn.silu(z.astype(dtype))).astype(x.dtype)


def linear_attention(spec: GatedDeltaNetSpec, qkv: jax.Array, g: jax.Array, beta: jax.Array, conv_weight: jax.Array,
                     conv_state: jax.Array, state: jax.Array, valid: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One group of rows through the convolution and the rule, from their states before the call.

    Args:
      spec: the layer's `GatedDeltaNetSpec`.
      qkv: `[rows, T, channels]`, the projections of q, k and v, each flattened over its heads, in that order.
      g, beta: `[rows, T, n_value_head]`, `decay` and `sigmoid(b)`.
      conv_weight: `[conv_kernel, channels]`.
      conv_state, state: `[rows, conv_kernel - 1, channels]` and float32 `[rows, n_value_head, key_dim,
        value_dim]` (`spec.initial_states`: zeros, a row with nothing before it).
      valid: bool `[rows, T]` or None: False on a row's padding after its end, which changes neither state.

    Returns:
      `(o [rows, T, n_value_head, value_dim] float32, conv_state, state)`: the rule's output and the
      states after the call, the recurrent form for one token, the chunked one for more.
    """
    s = spec
    x, conv_state = short_convolution(qkv, conv_weight, conv_state, valid)  # [rows, T, channels]
    key_width = s.n_key_head * s.key_dim
    q, k, v = jnp.split(x, [key_width, 2 * key_width], axis=-1)
    q, k = (l2_normalize(a.reshape(*a.shape[:2], s.n_key_head, s.key_dim)) for a in (q, k))  # [rows, T, n_key, d_k]
    v = v.reshape(*v.shape[:2], s.n_value_head, s.value_dim)  # [rows, T, heads, d_v]
    rule = recurrent_delta_rule if qkv.shape[1] == 1 else functools.partial(chunked_delta_rule, chunk=s.chunk)
    o, state = rule(q, k, v, g, beta, state, valid)
    return o, conv_state, state


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The "linear" mixer kind: Gated DeltaNet (module docstring), whose cache is a row's conv inputs
    and recurrent state, constant in the length.

    Attributes:
      n_key_head, n_value_head: heads of q and k, and of v (a multiple); config.json's
        `linear_num_key_heads`, `linear_num_value_heads`.
      key_dim, value_dim: channels per head (`linear_key_head_dim`, `linear_value_head_dim`).
      conv_kernel: the short convolution's taps (`linear_conv_kernel_dim`).
      chunk: tokens per step of the chunked form (memory per step ~ chunk^2 per head).
    """

    n_key_head: int
    n_value_head: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    chunk: int = 64

    def __post_init__(self):
        for field in ("n_key_head", "n_value_head", "key_dim", "value_dim", "conv_kernel", "chunk"):
            if getattr(self, field) < 1:
                raise ValueError(f"GatedDeltaNetSpec.{field} must be at least 1 (got {getattr(self, field)})")
        if self.n_value_head % self.n_key_head:
            raise ValueError(f"GatedDeltaNetSpec.n_value_head must be a multiple of n_key_head={self.n_key_head} "
                             f"(got {self.n_value_head})")

    @property
    def attention_type(self) -> str:
        """"linear": a cache keeps the layer's states, not slots of keys."""
        return "linear"

    @property
    def window(self) -> None:
        """No window: a linear layer reads its whole past, through its state."""
        return None

    @property
    def cache_entry(self) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """What a layer of this spec keeps per row (`jaxformer.cache.Entry`): its conv inputs
        `[conv_kernel - 1, channels]` and its state `[n_value_head, key_dim, value_dim]`, at any length."""
        return "linear", ((self.conv_kernel - 1, self.channels), (self.n_value_head, self.key_dim, self.value_dim))

    @property
    def rotation(self) -> None:
        """No RoPE: positions reach a linear layer through its convolution and its state's order."""
        return None

    def rope(self, position: jax.Array) -> tuple[jax.Array, jax.Array]:
        """No angles: `cos, sin` `[..., T, 0]`, which say the call's positions (a part's rows and length)."""
        empty = jnp.zeros((*position.shape, 0), jnp.float32)
        return empty, empty

    def view(self, position: jax.Array, key_position: jax.Array, rope=None) -> tuple[jax.Array, jax.Array, Visibility]:
        """The mixers' view of a call (`AttentionSpec.view`): no angles, and keys it never reads."""
        cos, sin = self.rope(position) if rope is None else rope
        return cos, sin, Visibility(position, key_position, jnp.int32(FULL_WINDOW))

    @property
    def channels(self) -> int:
        """The convolution's channels: q's, k's and v's, `2 n_key_head key_dim + n_value_head value_dim`."""
        return 2 * self.n_key_head * self.key_dim + self.n_value_head * self.value_dim

    def initial_states(self, rows: int, dtype) -> tuple[jax.Array, jax.Array]:
        """`(conv_state [rows, conv_kernel - 1, channels] in dtype, state float32 [rows, n_value_head,
        key_dim, value_dim])`, zeros: the states of rows with nothing before them."""
        conv, state = self.cache_entry[1]
        return jnp.zeros((rows, *conv), dtype), jnp.zeros((rows, *state), jnp.float32)

    def weights(self, d_model: int) -> dict[str, Weight]:
        """The parameters a layer of this spec holds, by name (the gated norm's `norm/weight` is its
        submodule's). Key heads shard as GQA's kv heads, value heads as its query heads: a device
        holding value heads `h` holds the key heads `h // r` they read."""
        Hk, Hv, Dk, Dv, K = self.n_key_head, self.n_value_head, self.key_dim, self.value_dim, self.conv_kernel
        return {"wq": Weight((d_model, Hk, Dk), (EMBED, KV_HEADS, HEAD_DIM)),
                "wk": Weight((d_model, Hk, Dk), (EMBED, KV_HEADS, HEAD_DIM)),
                "wv": Weight((d_model, Hv, Dv), (EMBED, HEADS, HEAD_DIM)),
                "wz": Weight((d_model, Hv, Dv), (EMBED, HEADS, HEAD_DIM)),  # the output gate's
                "wb": Weight((d_model, Hv), (EMBED, HEADS)),  # beta's
                "wa": Weight((d_model, Hv), (EMBED, HEADS)),  # the decay's
                "conv_q": Weight((Hk, Dk, K), (KV_HEADS, HEAD_DIM, CONV), inputs=0),  # (a channel's taps together,
                "conv_k": Weight((Hk, Dk, K), (KV_HEADS, HEAD_DIM, CONV), inputs=0),  # as a checkpoint's conv1d
                "conv_v": Weight((Hv, Dv, K), (HEADS, HEAD_DIM, CONV), inputs=0),  # holds them: [channels, 1, K])
                "a_log": Weight((Hv,), (HEADS,), inputs=0),
                "dt_bias": Weight((Hv,), (HEADS,), inputs=0),
                "wo": Weight((Hv, Dv, d_model), (HEADS, HEAD_DIM, EMBED), inputs=2)}

    def build(self, config, name: str) -> GatedDeltaNet:
        """The module of a layer of this spec, named `name` in its block."""
        return GatedDeltaNet(config, self, name=name)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` over each value head's channels, its weight `[value_dim]` starting at ones."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        weight = param(self, "weight", nn.initializers.ones, (x.shape[-1],), (HEAD_DIM,), self.param_dtype)
        return gated_rms_norm(x, z, weight, self.eps)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (a mixer of kind `GatedDeltaNetSpec`), called as `GQASelfAttention` is.

    Attributes:
      config: the model's `DecoderConfig` (d_model, `norm_eps`, LoRA, dtypes).
      spec: this layer's `GatedDeltaNetSpec`.
    """

    config: "DecoderConfig"  # noqa: F821 (jaxformer.config)
    spec: GatedDeltaNetSpec
    linear_adapters: ClassVar[bool] = True  # LoRA: `project` gives its products `LINEAR_ADAPTERS` alone

    @nn.compact
    def __call__(self, x, parts, layer=None, is_sliding=None, keep_kv: bool = False):
        """`(y [batch, T, d_model], caches)` of `x [batch, T, d_model]` (a grouped call's `[1, N,
        d_model]`), each of the call's `attention.Part`s run from its rows' states: layer `layer`'s
        in its cache (`cache.layer(layer, ("linear",))`, written back after the call; a row's tokens
        at positions from `cache.stop` on are padding, which changes neither state), or zeros without
        one (and none kept). `is_sliding`: the mixers' protocol; unread."""
        c, s = self.config, self.spec
        table = s.weights(c.d_model)

        def weight(name, initializer=None):  # (None: normal, std 0.02)
            return compute_param(self, name, initializer or nn.initializers.normal(0.02), *table[name][:2])

        def uniform(bound):  # torch's default for a depthwise conv1d: +-1/sqrt(taps)
            return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)

        # The output projection adds into the residual stream once per block (GPT-2's 1/sqrt(2L), as attention's).
        wo = weight("wo", nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer)))
        q, k, v, z, b, a = project(self, x, *((name, equation, weight(name)) for name, equation in (
            ("wq", "btd,dnk->btnk"), ("wk", "btd,dnk->btnk"),  # [batch, T, n_key_head, key_dim]
            ("wv", "btd,dhv->bthv"), ("wz", "btd,dhv->bthv"),  # [batch, T, n_value_head, value_dim]
            ("wb", "btd,dh->bth"), ("wa", "btd,dh->bth"))))  # [batch, T, n_value_head]
        qkv = jnp.concatenate([p.reshape(*p.shape[:2], -1) for p in (q, k, v)], axis=-1)  # [batch, T, channels]
        taps = [weight(f"conv_{p}", uniform(s.conv_kernel ** -0.5)) for p in "qkv"]  # [heads, channels/head, K]
        conv_weight = jnp.concatenate([w.reshape(-1, s.conv_kernel) for w in taps], axis=0).T  # [K, channels]
        a_log = param(self, "a_log", lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 0.01, 16)),
                      *table["a_log"][:2], c.param_dtype)  # A in [0.01, 16] (transformers' init)
        dt_bias = param(self, "dt_bias", nn.initializers.ones, *table["dt_bias"][:2], c.param_dtype)
        g, beta = decay(a, a_log, dt_bias), jax.nn.sigmoid(b)  # [batch, T, heads]

        grouped = len(parts) > 1
        outs, written, start = [], [], 0
        for part in parts:  # (one, unless groups of rows share the call: each from its own states)
            cache, valid = part.cache, None
            if cache is None:
                conv_state, state = s.initial_states(part.rows, qkv.dtype)
            else:
                view = cache.layer(layer, ("linear",))
                conv_state, state = view.read()  # [rows, K - 1, channels], [rows, heads, d_k, d_v]
                if cache.stop is not None:  # [rows, T]: the tokens before each row's stop
                    valid = cache.pos[:, None] + jnp.arange(part.T) < cache.stop[:, None]
            o, conv_state, state = linear_attention(s, *(part.take(p, start, grouped) for p in (qkv, g, beta)),
                                                    conv_weight, conv_state, state, valid)
            if cache is not None:
                cache = cache.with_layer(layer, view.write(conv_state, state))
            outs.append(o.reshape(1, -1, *o.shape[2:]) if grouped else o)
            written.append(cache)
            start += part.rows * part.T
        o = (jnp.concatenate(outs, axis=1) if grouped else outs[0]).astype(x.dtype)  # [batch, T, heads, d_v]
        o = GatedRMSNorm(c.norm_eps, c.param_dtype, name="norm")(o, z)  # norm(o) * silu(z), per head
        (y,) = project(self, o, ("wo", "bthv,hvd->btd", wo))  # [batch, T, d_model]
        return y, tuple(written), None  # (the mixers' protocol: no layer reads a linear layer's keys)
