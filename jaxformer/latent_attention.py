"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2): the keys and values of every
head come from one low-rank latent a token, and one RoPE key all heads share.

    q            = x W_Q   or   norm(x W_QA) W_QB      [T, H, nope + rope] = [q_nope | q_rope]
    [c | k_rope] = x W_KVA;   c = norm(c)              [S, r], [S, rope]   (one of each a token)
    [k_nope | v] = c W_KVB                             [S, H, nope], [S, H, dv]
    scores       = (q_nope . k_nope + q_rope . k_rope) * scale    (q_rope, k_rope rotated)
    y            = softmax(scores) v W_O               [T, d]

That expanded form serves a call without a cache (prompts, training). A cache keeps only c and
the rotated k_rope a token, r + rope numbers (DeepSeek-V3: 512 + 64 = 576, against 128 heads of
192 + 128 expanded), and a call over it attends in the latent space, W_KVB = [W_UK | W_UV]
absorbed into the query and the output:

    q_lat  = q_nope W_UK^T                             [T, H, r]    (q_nope . k_nope = q_lat . c)
    scores = ([q_lat | q_rope] . [c | k_rope]) * scale     one key of r + rope for every head
    y      = ((softmax(scores) c) W_UV) W_O            [T, H, r] -> [T, H, dv] -> [T, d]

Einsum letters: b batch (rows), t query, s key, d d_model, h head, k channel of a head,
l latent channel (c's), q channel of the query's own latent.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import FULL_WINDOW, Part, Visibility, attend, of_type
from jaxformer.lora import project, with_adapter
from jaxformer.norms import RMSNorm
from jaxformer.positions import apply_rope, rope_attention_factor, rope_cos_sin, rope_frequencies
from jaxformer.products import product
from jaxformer.quantized import QArray, dequantize
from jaxformer.sharding import EMBED, HEAD_DIM, HEADS, LATENT, Weight, compute_param

# The latents' RMSNorms take DeepSeek's epsilon whatever the checkpoint's `rms_norm_eps` (its
# code, and transformers', build them with their default).
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scaling: "RopeScaling | None") -> float:  # noqa: F821 (jaxformer.config)
    """`0.1 * mscale_all_dim * ln(factor) + 1` of a YaRN `scaling` that states `mscale_all_dim`
    (1 for a factor of at most 1); 1 otherwise: what transformers' `yarn_apply_mscale` multiplies
    a latent attention's softmax scale by, squared."""
    if scaling is None or scaling.kind != "yarn" or not scaling.mscale_all_dim or scaling.factor <= 1:
        return 1.0
    return 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0


@dataclasses.dataclass(frozen=True)
class LatentAttentionSpec:
    """The "latent attention" mixer kind of a decoder layer (the module's docstring).

    Attributes:
      n_head: H, the query heads (every one reads the same latent).
      q_lora_rank: the query's own latent width (`W_QA`, its norm, `W_QB`); None: one `W_Q`.
      kv_lora_rank: r, the latent's width, what the cache keeps a token besides k_rope.
      qk_nope_head_dim, qk_rope_head_dim: a head's query (and key) channels without and with RoPE.
      v_head_dim: a head's value channels.
      rope_theta, rope_scaling: RoPE's base and `RopeScaling` over the `qk_rope_head_dim` channels;
        a YaRN scaling's `mscale_all_dim` scales the scores too (`softmax_scale`).
      rope_pairing: which channels RoPE rotates together: "interleaved" (DeepSeek's
        `rope_interleave`, V2's complex pairs) or "split_half".
      window: keys a query reads, itself included; None: every earlier one.
      scale: the scores' scale; None: transformers' (`softmax_scale`).
    """

    n_head: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: "RopeScaling | None"  # noqa: F821 (jaxformer.config)
    rope_pairing: str = "interleaved"
    window: int | None = None
    scale: float | None = None

    def __post_init__(self):
        for field in ("n_head", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1 or (field == "qk_rope_head_dim" and value % 2):
                raise ValueError(f"LatentAttentionSpec.{field} must be an int >= 1"
                                 f"{', even (RoPE pairs)' if field == 'qk_rope_head_dim' else ''} (got {value!r})")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"LatentAttentionSpec.q_lora_rank must be None or an int >= 1 (got {self.q_lora_rank!r})")

    @property
    def qk_head_dim(self) -> int:
        """A head's query and key channels, `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotation(self) -> tuple:
        """What RoPE's angles depend on, `(channels, base, scaling)`: the `qk_rope_head_dim` channels
        alone (`decoder.views` computes one RoPE for the mixers that rotate alike)."""
        return self.qk_rope_head_dim, self.rope_theta, self.rope_scaling

    @property
    def cache_entry(self) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """What a layer of this spec keeps per row (`jaxformer.cache.Entry`): a slot's "key" the
        normed latent `[1, kv_lora_rank]` and its "value" the rotated RoPE key `[1, qk_rope_head_dim]`,
        one each a token whatever the heads."""
        return self.attention_type, ((1, self.kv_lora_rank), (1, self.qk_rope_head_dim))

    @property
    def softmax_scale(self) -> float:
        """`scale`, else transformers': `qk_head_dim ** -0.5`, times `yarn_mscale(rope_scaling) ** 2`
        (YaRN's `attention_factor` already scales cos and sin, so the RoPE channels' scores take
        its square besides)."""
        return self.scale if self.scale is not None else self.qk_head_dim ** -0.5 * yarn_mscale(self.rope_scaling) ** 2

    def weights(self, d_model: int) -> dict[str, Weight]:
        """The matrices a layer of this spec holds, by name (as `AttentionSpec.weights`); the
        latents' norms are the modules `q_a_norm` and `kv_a_norm`. Heads split over the model
        axis; a latent, which every head reads, does not."""
        H, r, dv = self.n_head, self.kv_lora_rank, self.v_head_dim
        weights = {}
        if self.q_lora_rank is None:
            weights["wq"] = Weight((d_model, H, self.qk_head_dim), (EMBED, HEADS, HEAD_DIM))
        else:
            weights["wq_a"] = Weight((d_model, self.q_lora_rank), (EMBED, LATENT))
            weights["wq_b"] = Weight((self.q_lora_rank, H, self.qk_head_dim), (LATENT, HEADS, HEAD_DIM))
        weights["wkv_a"] = Weight((d_model, r + self.qk_rope_head_dim), (EMBED, LATENT))  # [c | k_rope]
        weights["wkv_b"] = Weight((r, H, self.qk_nope_head_dim + dv), (LATENT, HEADS, HEAD_DIM))  # [W_UK | W_UV]
        weights["wo"] = Weight((H, dv, d_model), (HEADS, HEAD_DIM, EMBED), inputs=2)
        return weights

    def build(self, config, name: str) -> "LatentAttention":
        """The module of a layer of this spec, named `name` in its block."""
        return LatentAttention(config, self, name=name)

    @property
    def attention_type(self) -> str:
        """"sliding" with a window, else "full": which slots a cache keeps for the layer (a ring, or all)."""
        return "full" if self.window is None else "sliding"

    def rope(self, position: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE's `cos, sin` `[..., T, qk_rope_head_dim/2]` at `position` (int `[T]` or `[batch, T]`)."""
        inv_freq = rope_frequencies(position, self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)
        return rope_cos_sin(position, inv_freq, rope_attention_factor(self.rope_scaling))

    def view(self, position: jax.Array, key_position: jax.Array, rope=None) -> tuple[jax.Array, jax.Array, Visibility]:
        """RoPE's `cos, sin` at the query positions (`rope(position)`, or `rope`) and the
        `Visibility` of the keys at `key_position`, as `AttentionSpec.view` gives them."""
        cos, sin = self.rope(position) if rope is None else rope
        window = FULL_WINDOW if self.window is None else self.window
        return cos, sin, Visibility(position, key_position, jnp.int32(window))


def attend_widths(q: jax.Array, k: jax.Array, v: jax.Array, seen: Visibility, **options):
    """`attention.attend` of `q, k [.., width]` over values `v [.., v_width]` of another width:
    the narrower zero-padded to the wider (a zero channel adds nothing to a score or an output;
    the blocked paths and the kernels take one width), the output cut back to `v_width`."""
    width = max(q.shape[-1], v.shape[-1])

    def padded(a):
        return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])

    out, weights = attend(padded(q), padded(k), padded(v), seen, **options)
    return out[..., :v.shape[-1]], weights


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with RoPE and a latent cache (a mixer of kind
    `LatentAttentionSpec`), called as `GQASelfAttention` is.

    Attributes:
      config: the model's `DecoderConfig` (d_model, the norms' form, LoRA, dtypes, `attention_impl`).
      spec: this layer's `LatentAttentionSpec`.
    """

    config: "DecoderConfig"  # noqa: F821 (jaxformer.config)
    spec: LatentAttentionSpec

    @nn.compact
    def __call__(self, x, parts: tuple[Part, ...], layer=None, is_sliding=None, keep_kv: bool = False):
        """Attends causally over `x` (and the cache).

        Args:
          x: `[batch, T, d_model]` normalised residual stream (a grouped call's `[1, N, d_model]`).
          parts: the call's `Part`s (`GQASelfAttention`'s): each part's cache, if any, keeps this
            layer's latents as its k `[rows, slots, 1, kv_lora_rank]` and RoPE keys as its v
            `[rows, slots, 1, qk_rope_head_dim]`.
          layer: this layer's index in the caches (traced in a scan).
          is_sliding: bool `[]` in a scan over both types: this layer's, which picks its mask.
          keep_kv: the mixers' protocol (`GQASelfAttention`'s); no layer reads a latent layer's keys.

        Returns:
          `(y [batch, T, d_model], caches, None)`, each part's cache with this call's latents and RoPE
          keys written; the weights `[batch, H, T, S]` sown as `GQASelfAttention` sows them.
        """
        c, a = self.config, self.spec
        table = a.weights(c.d_model)
        init = nn.initializers.normal(0.02)
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))  # (as GQASelfAttention's W_O)
        nope, r = a.qk_nope_head_dim, a.kv_lora_rank

        def weight(name, initializer=init):
            return compute_param(self, name, initializer, *table[name][:2])

        def latent_norm(name):
            return RMSNorm(LATENT_NORM_EPS, c.param_dtype, c.norm_plus_one, LATENT, name=name)

        if a.q_lora_rank is None:
            (q,) = project(self, x, ("wq", "btd,dhk->bthk", weight("wq")))  # [batch, T, H, nope + rope]
        else:
            (q_a,) = project(self, x, ("wq_a", "btd,dq->btq", weight("wq_a")))  # [batch, T, q_lora_rank]
            (q,) = project(self, latent_norm("q_a_norm")(q_a), ("wq_b", "btq,qhk->bthk", weight("wq_b")))
        (kv_a,) = project(self, x, ("wkv_a", "btd,dl->btl", weight("wkv_a")))  # [batch, T, r + rope]
        latent = latent_norm("kv_a_norm")(kv_a[..., :r])[:, :, None]  # [batch, T, 1, r]: one "head"
        rope_key = kv_a[..., None, r:]  # [batch, T, 1, rope]
        wkv_b, wo = weight("wkv_b"), weight("wo", residual_init)  # [r, H, nope + dv], [H, dv, d_model]
        options = dict(kind=c.attention_impl, scale=a.softmax_scale)
        if any(part.cache is not None for part in parts):  # W_KVB's halves, read apart (an adapter's change merged)
            w_kv_b = with_adapter(self, "wkv_b", dequantize(wkv_b, wkv_b.dtype) if isinstance(wkv_b, QArray) else wkv_b)
            # (a quantized W_KVB dequantized for the call: its two parts read other than as `x W`)
            w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]  # [r, H, nope], [r, H, dv]

        grouped = len(parts) > 1
        outs, written, start = [], [], 0
        for part in parts:  # (one, unless groups of rows share the call: each attends in its own cache)
            part_q = part.take(q, start, grouped)
            q_nope = part_q[..., :nope]  # [rows, T, H, nope]
            q_rope = apply_rope(part_q[..., nope:], part.cos, part.sin, a.rope_pairing)  # [rows, T, H, rope]
            part_latent = part.take(latent, start, grouped)
            part_rope_key = apply_rope(part.take(rope_key, start, grouped), part.cos, part.sin, a.rope_pairing)

            def seen(kind, masks=part.masks):  # the keys read as a layer of `kind` reads them (None: this layer's)
                return masks[kind] if kind else of_type(masks, is_sliding)

            cache = part.cache
            if cache is None:  # expanded: every head's keys and values, from this call's latents
                (kv,) = project(self, part_latent[:, :, 0], ("wkv_b", "bsl,lhk->bshk", wkv_b))  # [rows, S, H, nope+dv]
                k_rope = jnp.broadcast_to(part_rope_key, (*kv.shape[:3], q_rope.shape[-1]))  # the same for every head
                keys = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)  # [rows, S, H, nope + rope]
                out, weights = attend_widths(jnp.concatenate([q_nope, q_rope], axis=-1), keys, kv[..., nope:],
                                             seen(None), **options)  # [rows, T, H, dv]
            else:  # absorbed: the layer's view writes this call's latents and gives those it reads
                q_latent = product("bthk,lhk->bthl", q_nope, w_uk)  # [rows, T, H, r]

                def read(latents, rope_keys, kind=None, q_latent=q_latent, q_rope=q_rope, seen=seen):
                    # latents [rows, S, 1, r], rope_keys [rows, S, 1, rope]: one key [c | k_rope] for every head.
                    # (The concatenation copies what the step reads; it buys attend's masks, blocks and kernels.)
                    keys = jnp.concatenate([latents, rope_keys.astype(latents.dtype)], axis=-1)
                    out, weights = attend_widths(jnp.concatenate([q_latent, q_rope], axis=-1), keys, latents,
                                                 seen(kind), **options)  # [rows, T, H, r]: softmax(scores) c
                    return product("bthl,lhk->bthk", out.astype(q_latent.dtype), w_uv), weights  # [rows, T, H, dv]

                view = cache.layer(layer, tuple(part.masks))
                (out, weights), view = view.attend(read, part_latent, part_rope_key, cache.pos, cache.stop,
                                                   cache.read_slots)
                cache = cache.with_layer(layer, view)
            if weights is not None and not grouped:
                self.sow("intermediates", "attention_weights", weights)  # a no-op unless asked for (mutable)
            outs.append(out.reshape(1, -1, *out.shape[2:]) if grouped else out)
            written.append(cache)
            start += part.rows * part.T
        out = jnp.concatenate(outs, axis=1) if grouped else outs[0]  # [batch, T, H, dv]
        (y,) = project(self, out, ("wo", "bthk,hkd->btd", wo))  # [batch, T, d_model]
        return y, tuple(written), None
