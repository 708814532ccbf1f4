"""Model configurations: frozen dataclasses that validate themselves, so an inconsistent
config never reaches a model; `config.replace(...)` validates a variant again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax.numpy as jnp

from jaxformer.validation import as_bool, as_float, as_floating_dtype, as_int, check_fields, one_of, require

ROPE_PAIRINGS = ("split_half", "interleaved")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope", "proportional")
ATTENTION_TYPES = ("full", "sliding")  # a layer reads every earlier position, or the last `sliding_window`
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # the compute dtypes a command takes by name
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's nonlinearity: SwiGLU (Llama), GeGLU with tanh GELU (Gemma)
REMAT_POLICIES = ("dots_no_batch", "dots", "nothing")  # what a rematerialised block keeps (DecoderConfig.remat_policy)
ATTENTION_IMPLS = ("auto", "dense", "blocks")  # jaxformer.attention.attend: every score at once, or key blocks


def swiglu_hidden_dim(d_model: int) -> int:
    """The default SwiGLU width, 8/3 * d_model rounded to a multiple of 64: with three matrices
    it keeps the parameters of a two-matrix FFN of width 4 * d_model (3 * d * 8d/3 == 2 * d * 4d)."""
    return int(round(d_model * 8 / 3 / 64) * 64)


def _check(config, check, *fields: str, **limits) -> None:
    """Each of `fields` checked and normalised by `check` (`jaxformer.validation`), named `ClassName.field`."""
    check_fields(config, lambda field: f"{type(config).__name__}.{field}", check, *fields, **limits)


def _require(config, condition: bool, field: str, rule: str) -> None:
    """A rule between fields, named by the field it is stated of."""
    require(condition, f"{type(config).__name__}.{field}", rule, getattr(config, field))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE's frequencies past the context it was trained at
    (docs/architecture.md, "RoPE scaling"); transformers calls it `rope_scaling`.

    Attributes:
      kind: "linear" (every frequency divided by `factor`), "llama3" (Llama 3.1's: long
        wavelengths divided by `factor`, short ones kept, a blend between) or "yarn"
        (per frequency, a ramp between divided and kept by the turns it makes in the
        trained context; cos and sin scaled by `attention_factor`).
      factor: how many times longer the context is than the one trained at, > 0.
      original_max_position_embeddings: the context trained at ("llama3", "yarn").
      low_freq_factor, high_freq_factor: "llama3" only: wavelengths above
        `original_max_position_embeddings / low_freq_factor` are scaled, below
        `... / high_freq_factor` kept; `high_freq_factor > low_freq_factor > 0`.
      beta_fast, beta_slow: "yarn" only: frequencies that turn more than `beta_fast` times
        in the trained context are kept, fewer than `beta_slow` times divided (32 and 1).
      attention_factor: "yarn" and "longrope": the scale of cos and sin; None: YaRN's
        `0.1 ln(factor) + 1`, LongRoPE's `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`.
      truncate: "yarn" only: the ramp's ends rounded outwards to whole channels.
      mscale_all_dim: "yarn" only, read by multi-head latent attention alone (as transformers'
        `yarn_apply_mscale`): its softmax scale is multiplied by `(0.1 mscale_all_dim ln(factor)
        + 1)^2` (`jaxformer.latent_attention`); None: not. Other mixers ignore it, as
        transformers' do.
      short_factor, long_factor: "longrope" only (Phi-3's long context): pair i's wavelength
        is multiplied by `short_factor[i]` in a call whose positions all lie within
        `original_max_position_embeddings`, by `long_factor[i]` in one that reaches past it.
      partial_rotary_factor: "proportional" only (Gemma 4's global layers): the first
        `int(partial_rotary_factor * head_dim // 2)` pairs turn at the unscaled frequencies of the
        whole head, `theta ** (-2i / head_dim)`, the other pairs not at all; every frequency is then
        divided by `factor` (1: none).
    """

    kind: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    mscale_all_dim: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float | None = None

    _FIELDS: ClassVar[dict] = {
        "linear": (), "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate",
                 "mscale_all_dim"),
        "longrope": ("original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
        "proportional": ("partial_rotary_factor",)}

    def __post_init__(self):
        _check(self, one_of, "kind", choices=ROPE_SCALINGS)
        _check(self, as_float, "factor", above=0)
        for field in {f for fields in self._FIELDS.values() for f in fields} - set(self._FIELDS[self.kind]):
            _require(self, getattr(self, field) is None, field, f"None for kind={self.kind!r}")
        if self.kind not in ("linear", "proportional"):
            _check(self, as_int, "original_max_position_embeddings", minimum=1)
        if self.kind == "proportional":
            _check(self, as_float, "partial_rotary_factor", above=0)
            _require(self, self.partial_rotary_factor <= 1, "partial_rotary_factor", "at most 1")
        if self.kind == "llama3":
            _check(self, as_float, "low_freq_factor", "high_freq_factor", above=0)
            _require(self, self.high_freq_factor > self.low_freq_factor, "high_freq_factor",
                     f"above low_freq_factor={self.low_freq_factor:g}")
        if self.kind == "longrope":
            for field in ("short_factor", "long_factor"):
                factors = getattr(self, field)
                _require(self, isinstance(factors, (tuple, list)) and len(factors) > 0 and all(
                    isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors), field,
                    "a list of finite numbers > 0, one per RoPE pair")
                object.__setattr__(self, field, tuple(float(f) for f in factors))
            _require(self, len(self.long_factor) == len(self.short_factor), "long_factor",
                     f"as long as short_factor ({len(self.short_factor)})")
            _check(self, as_float, "attention_factor", above=0, optional=True)
        if self.kind == "yarn":  # (unset fields stay None: `replace(factor=...)` moves their defaults along)
            _check(self, as_float, "beta_fast", "beta_slow", "attention_factor", "mscale_all_dim", above=0,
                   optional=True)
            _check(self, as_bool, "truncate", optional=True)
            beta_fast, beta_slow, _ = self.ramp
            # (equal: Kimi K2's 1 and 1, a ramp of no width, as transformers takes it)
            _require(self, beta_fast >= beta_slow, "beta_fast", f"at least beta_slow={beta_slow:g}")

    def replace(self, **changes) -> "RopeScaling":
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def ramp(self) -> tuple[float, float, bool]:
        """YaRN's `(beta_fast, beta_slow, truncate)`, unset ones at their defaults 32, 1 and True."""
        return (32.0 if self.beta_fast is None else self.beta_fast, 1.0 if self.beta_slow is None else self.beta_slow,
                True if self.truncate is None else self.truncate)

    @property
    def cos_sin_scale(self) -> float:
        """What RoPE's cos and sin are multiplied by: YaRN's or LongRoPE's `attention_factor`
        (unset: `0.1 ln(factor) + 1`, or `sqrt(1 + ln(factor) / ln(original context))`; 1 for
        `factor <= 1`); 1 for the other kinds."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1:
            return 1.0
        if self.kind == "yarn":
            return 0.1 * math.log(self.factor) + 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))


# LoRA's targets, by peft's (transformers') names, and the adapter each is in a block: a module's
# (peft's `target_modules`): a matrix of its own, or Phi-3's fused ones, one adapter over several
# matrices' columns; or a parameter's (peft's `target_parameters`): a layer of experts' stacked
# matrices, as transformers 5 holds them (`mlp.experts.gate_up_proj` `[E, 2F, d]`, the gate's
# rows then up's, and `down_proj` `[E, d, F]`), one adapter per expert; peft's name of a parameter
# is its own or a dotted tail of it, and Gemma 4's experts, beside its MLP, are `experts.*`, not
# `mlp.experts.*` (each family's spelling first: `jaxformer.convert.peft.all_targets`). A latent attention's
# (DeepSeek's) are its low-rank query's two, its latent's down- and up-projections, and `o_proj`.
# A Gated DeltaNet layer's (`linear_attn.*`) are adapters of their own (`LINEAR_ADAPTERS`), which
# adapt that kind of layer alone: its `wq` and `wo` are other modules than an attention layer's
# `q_proj` and `o_proj`. Each target applies to the layers whose checkpoint has its module.
LORA_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
                "qkv_proj": "wqkv", "gate_up_proj": "w_gate_up",
                "q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a", "kv_b_proj": "wkv_b",
                "in_proj_qkv": "linear_qkv", "in_proj_z": "linear_z", "in_proj_b": "linear_b",
                "in_proj_a": "linear_a", "out_proj": "linear_o", "in_proj_qkvz": "linear_qkvz",
                "in_proj_ba": "linear_ba",
                "mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down",
                "experts.gate_up_proj": "experts_gate_up", "experts.down_proj": "experts_down"}
FUSED_ADAPTERS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}  # -> the matrices, in order
# -> the Gated DeltaNet's matrices each changes, in the order of `b`'s columns (Qwen3.5's `in_proj_qkv`:
# every head's q, then k, then v, as its rows; Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` group their
# rows per key head, which peft's files keep: `jaxformer.convert.peft` reorders them).
LINEAR_ADAPTERS = {"linear_qkv": ("wq", "wk", "wv"), "linear_z": ("wz",), "linear_b": ("wb",), "linear_a": ("wa",),
                   "linear_o": ("wo",), "linear_qkvz": ("wq", "wk", "wv", "wz"), "linear_ba": ("wb", "wa")}
EXPERT_ADAPTERS = {"experts_gate_up": ("w_gate", "w_up"), "experts_down": ("w_down",)}  # -> the stacked matrices


def adapter_matrices(adapter: str) -> tuple[str, ...]:
    """The matrices an adapter changes, in the order of its `b`'s columns: itself, or a fused
    adapter's, a Gated DeltaNet's or an experts' adapter's."""
    return EXPERT_ADAPTERS.get(adapter) or FUSED_ADAPTERS.get(adapter) or LINEAR_ADAPTERS.get(adapter, (adapter,))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA on a decoder: which matrices learn a low-rank change `(alpha / rank) * A @ B`.

    Attributes:
      rank: r, the adapters' inner size, >= 1.
      alpha: the scale's numerator (peft's `lora_alpha`), > 0.
      targets: peft's names of the adapted matrices (`LORA_TARGETS`' keys), in each block whose
        checkpoint has that module (a hybrid's `q_proj` its attention layers', `in_proj_qkv` its
        Gated DeltaNet layers'); Phi-3's `qkv_proj` and `gate_up_proj` are one adapter over the
        fused matrices, as are Qwen3.5's `in_proj_qkv`, Qwen3-Next's `in_proj_qkvz`, `in_proj_ba`; a layer
        of experts' `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (peft's
        `target_parameters`; Gemma 4's `experts.gate_up_proj`, `experts.down_proj`) an adapter per
        expert, in every layer of experts.
      dropout: the rate of the dropout on each adapter's input (peft's `lora_dropout`), in
        [0, 1); it applies only where a `dropout` rng is given, as in training. 0 with the
        experts' targets (peft adapts a parameter with none).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self):
        _check(self, as_int, "rank", minimum=1)
        _check(self, as_float, "alpha", above=0)
        _check(self, as_float, "dropout", at_least=0, below=1)
        targets = self.targets
        _require(self, isinstance(targets, (tuple, list)) and len(targets) > 0 and len(set(targets)) == len(targets)
                 and all(t in LORA_TARGETS for t in targets), "targets",
                 f"distinct names among {', '.join(LORA_TARGETS)}")
        object.__setattr__(self, "targets", tuple(targets))
        _require(self, len(set(self.adapters)) == len(self.adapters), "targets",
                 "names of distinct parameters (experts.gate_up_proj is a tail of mlp.experts.gate_up_proj: "
                 "one parameter)")
        for linear in (False, True):  # (a Gated DeltaNet layer's matrices are not an attention layer's)
            matrices = [m for adapter in self.adapters if adapter not in EXPERT_ADAPTERS
                        and (adapter in LINEAR_ADAPTERS) == linear for m in adapter_matrices(adapter)]
            _require(self, len(set(matrices)) == len(matrices), "targets",
                     "names of distinct matrices (qkv_proj holds q, k and v; gate_up_proj gate and up; "
                     "in_proj_qkvz q, k, v and z; in_proj_ba b and a)")
        _require(self, self.dropout == 0 or not self.expert_adapters, "dropout",
                 f"0 with the experts' targets ({', '.join(self.parameter_targets)}): peft adapts a parameter "
                 "without dropout")

    def replace(self, **changes) -> "LoraConfig":
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def scale(self) -> float:
        """`alpha / rank`, what `A @ B` is multiplied by."""
        return self.alpha / self.rank

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapters' names in a block, a target's (`wq`, `w_up`, Phi-3's `wqkv`, ...)."""
        return tuple(LORA_TARGETS[t] for t in self.targets)

    @property
    def matrices(self) -> frozenset[str]:
        """The parameters an attention layer's or a dense MLP's adapter changes (`wq`, ...; `wqkv`
        changes wq, wk and wv), never the experts' (`expert_adapters`) nor a Gated DeltaNet's."""
        return frozenset(m for adapter in self.adapters if adapter not in EXPERT_ADAPTERS
                         and adapter not in LINEAR_ADAPTERS for m in adapter_matrices(adapter))

    @property
    def expert_adapters(self) -> tuple[str, ...]:
        """The adapters of the experts' stacked matrices (`experts_gate_up`, `experts_down`)."""
        return tuple(adapter for adapter in self.adapters if adapter in EXPERT_ADAPTERS)

    @property
    def module_targets(self) -> tuple[str, ...]:
        """The targets that are modules (peft's `target_modules`): every one but the experts'."""
        return tuple(t for t in self.targets if LORA_TARGETS[t] not in EXPERT_ADAPTERS)

    @property
    def parameter_targets(self) -> tuple[str, ...]:
        """The targets that are parameters (peft's `target_parameters`): the experts'."""
        return tuple(t for t in self.targets if LORA_TARGETS[t] in EXPERT_ADAPTERS)


class _ModelConfig:
    """What both configs share."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head: `d_model // n_head`."""
        return self.d_model // self.n_head

    @property
    def cache_storage_dtype(self):
        """The KV cache's storage dtype: `cache_dtype`, or the compute `dtype` when it is None."""
        return self.dtype if self.cache_dtype is None else self.cache_dtype

    def replace(self, **changes):
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)

    def _normalise_dtypes(self) -> None:
        """Stores each dtype as a numpy dtype: "bfloat16", jnp.bfloat16, np.dtype(...) alike."""
        optional = ("cache_dtype",) if self.cache_dtype is not None else ()
        _check(self, as_floating_dtype, "dtype", "param_dtype", *optional)


@dataclasses.dataclass(frozen=True)
class DecoderConfig(_ModelConfig):
    """The modern decoder-only Transformer (RMSNorm, RoPE, GQA, SwiGLU, KV cache); the
    defaults are a small Llama-shaped model.

    Attributes:
      vocab_size: number of token ids; valid ids are `0 .. vocab_size - 1`.
      n_layer: number of pre-norm blocks.
      n_head: query heads.
      n_kv_head: key/value heads; each serves `n_head // n_kv_head` query heads (GQA).
      d_model: residual stream width; head_dim is `d_model // n_head`.
      max_seq_len: longest sequence (prompt plus generated tokens) the model accepts.
      rope_theta: RoPE base; pair i rotates by `pos * rope_theta ** (-2i / head_dim)`.
      rope_scaling: a `RopeScaling` of those frequencies (Llama 3.x), or None.
      norm_eps: RMSNorm epsilon.
      d_ff: SwiGLU hidden width, or None for `swiglu_hidden_dim(d_model)` (which
        `replace(d_model=...)` rescales); the resolved width is `ffn_dim`.
      rope_pairing: "split_half" (HF Llama) or "interleaved" (Meta's Llama); docs/parity.md.
      tie_embeddings: the output head reuses the token embedding matrix.
      dtype: activation and compute dtype (docs/sharding.md, "Mixed precision").
      param_dtype: storage dtype of the parameters.
      cache_dtype: storage dtype of the KV cache; None means `dtype`.
      head_dim_override: channels per head when they are not `d_model // n_head` (some
        Qwen2 or Mistral checkpoints); the resolved width is `head_dim`.
      qkv_bias: Q, K and V projections carry a bias (Qwen2); the output projection never does.
      scan_layers: one block scanned over parameters stacked on a leading layer axis
        (`params["blocks"]`; a run of repeated layer specs each, `blocks_1`, ..., where the
        layers differ in shape) instead of one `block_{i}` per layer: the same math, a
        compile time that hardly grows with depth (docs/architecture.md, "Scanned layers").
      layer_types: each layer's attention, "full" or "sliding" (reads its last
        `sliding_window` positions, itself included); None: every layer "full". The
        resolved tuple is `attention_types`.
      sliding_window: positions a "sliding" layer reads; set exactly when one layer is sliding.
      local_rope_theta: RoPE base of the sliding layers, unscaled (Gemma 3's local base
        frequency); None: they rotate as the full layers do.
      qk_norm: an RMSNorm over each head's channels of q and of k, before RoPE (Qwen3, Gemma 3).
      norm_plus_one: every RMSNorm scales by `1 + weight`, in float32 (Gemma); weights start at 0.
      norm_float32_scale: every RMSNorm scales by its weight in float32, then casts (Gemma 4's
        order; without it the normalised value is cast first, Llama's).
      mlp_activation: the gate's nonlinearity, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      embed_scale: the token embeddings are multiplied by `sqrt(d_model)` (Gemma).
      query_pre_attn_scalar: scores are scaled by `query_pre_attn_scalar ** -0.5` instead of
        `head_dim ** -0.5` (Gemma 2 and 3); None: by `head_dim`.
      attn_logit_softcap: scores pass through `cap * tanh(score / cap)` before the mask (Gemma 2).
      final_logit_softcap: the logits pass through `cap * tanh(logit / cap)` (Gemma 2).
      post_norms: an RMSNorm on each sublayer's output before it joins the residual stream
        (Gemma 2 and 3: `x + norm(attn(norm(x)))`).
      layer_scalar: each layer's output stream is multiplied by a learned number of its own
        (Gemma 4's `layer_scalar`, stored in its checkpoints).
      per_layer_width: each layer reads an input of its own of this width per token, made
        from the token's row of a second embedding table and a projection of its embedding
        (Gemma 4's per-layer embeddings: `jaxformer.per_layer`); None: none.
      per_layer_vocab_size: the rows of that table (`vocab_size_per_layer_input`); None: `vocab_size`.
      hf_model_type: the checkpoint family (config.json's `model_type`) `load_hf` read, which
        `save_hf` writes again; None: "qwen2" with q/k/v biases, else "llama".
      lora: a `LoraConfig`: the model then adds each adapter of the `lora` variable
        collection to its matrix's product (`jaxformer.lora`); None: no adapters.
      remat: each block's activations are recomputed in the backward pass instead of kept
        (`flax.linen.remat`): less memory for a little more compute; the same math.
      remat_policy: with `remat`, what a block keeps for the backward pass
        (`jax.checkpoint_policies`): "dots_no_batch" the weight matrices' products (the
        projections and the FFN's, recomputing the cheap element-wise work and attention),
        "dots" every matrix product, "nothing" only the block's input.
      attention_impl: how attention is computed (`jaxformer.attention.attend`): "dense" builds
        every score (and gives the weights), "blocks" walks key blocks with an online softmax
        (memory linear in the length; docs/long_context.md), "auto" the first on short
        sequences and the second from 1024 x 1024 scores per head on.
      layers: each layer's `LayerSpec` (`jaxformer.layers`), `n_layer` of them, as a family
        (or a user) fills them in for layers the fields above cannot state: widths or kinds
        that differ from layer to layer. The model builds layer i from `layers[i]`, checked
        by `layer_specs`; d_model, the norms' form, LoRA and the dtypes stay model-wide.
        Empty: each layer's spec follows from the fields above (`layer_specs`).
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int = 2
    d_model: int = 256
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    d_ff: int | None = None
    rope_pairing: str = "split_half"
    tie_embeddings: bool = True
    dtype: Any = jnp.float32
    head_dim_override: int | None = None
    qkv_bias: bool = False
    param_dtype: Any = jnp.float32
    cache_dtype: Any = None
    scan_layers: bool = False
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    qk_norm: bool = False
    norm_plus_one: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    post_norms: bool = False
    norm_float32_scale: bool = False
    layer_scalar: bool = False
    per_layer_width: int | None = None
    per_layer_vocab_size: int | None = None
    hf_model_type: str | None = None
    lora: LoraConfig | None = None
    remat: bool = False
    remat_policy: str = "dots_no_batch"
    attention_impl: str = "auto"
    layers: tuple = ()

    def __post_init__(self):
        # Each field's kind first: the rules between fields below compare plain numbers.
        _require(self, self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling), "rope_scaling",
                 "None or a RopeScaling")
        _check(self, as_int, "vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len", minimum=1)
        _check(self, as_int, "d_ff", "head_dim_override", "per_layer_width", "per_layer_vocab_size", minimum=1,
               optional=True)
        _check(self, as_float, "rope_theta", "norm_eps", above=0)
        _check(self, as_bool, "tie_embeddings", "qkv_bias", "scan_layers", "qk_norm", "norm_plus_one", "embed_scale",
               "post_norms", "norm_float32_scale", "layer_scalar", "remat")
        _require(self, self.per_layer_vocab_size is None or self.per_layer_width is not None, "per_layer_vocab_size",
                 "None without per_layer_width")
        _require(self, self.lora is None or isinstance(self.lora, LoraConfig), "lora", "None or a LoraConfig")
        _require(self, self.lora is None or not self.scan_layers, "lora",
                 "None with scan_layers=True: adapters are kept per block (block_{i})")
        _check(self, one_of, "rope_pairing", choices=ROPE_PAIRINGS)
        _check(self, one_of, "mlp_activation", choices=MLP_ACTIVATIONS)
        _check(self, one_of, "attention_impl", choices=ATTENTION_IMPLS)
        _check(self, one_of, "remat_policy", choices=REMAT_POLICIES)
        _check(self, as_int, "sliding_window", minimum=1, optional=True)
        _check(self, as_float, "local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcap",
               "final_logit_softcap", above=0, optional=True)
        self._check_layer_types()
        self._check_layers()
        _require(self, self.hf_model_type is None or isinstance(self.hf_model_type, str), "hf_model_type",
                 "None or a model_type string")
        self._normalise_dtypes()
        _require(self, self.head_dim_override is not None or self.d_model % self.n_head == 0, "d_model",
                 f"divisible by n_head={self.n_head} (or set head_dim_override)")
        _require(self, self.n_head % self.n_kv_head == 0, "n_head", f"divisible by n_kv_head={self.n_kv_head}")
        _require(self, self.head_dim % 2 == 0, "head_dim_override" if self.head_dim_override else "d_model",
                 f"such that head_dim={self.head_dim} is even, for RoPE pairs")
        if self.rope_scaling is not None and self.rope_scaling.kind == "longrope":
            _require(self, len(self.rope_scaling.short_factor) == self.head_dim // 2, "rope_scaling",
                     f"longrope factors for head_dim // 2 = {self.head_dim // 2} pairs")

    def _check_layer_types(self) -> None:
        """`layer_types` stored as a tuple of `ATTENTION_TYPES`, one per layer, and a
        `sliding_window` exactly when a layer is sliding."""
        if self.layer_types is not None:
            types = self.layer_types
            _require(self, isinstance(types, (tuple, list)) and len(types) == self.n_layer
                     and all(t in ATTENTION_TYPES for t in types), "layer_types",
                     f"None or {self.n_layer} (n_layer) entries, each one of {ATTENTION_TYPES}")
            object.__setattr__(self, "layer_types", tuple(types))
        sliding = "sliding" in self.attention_types
        _require(self, (self.sliding_window is not None) == sliding, "sliding_window",
                 "an int >= 1 exactly when a layer_types entry is 'sliding'")
        _require(self, self.local_rope_theta is None or sliding, "local_rope_theta",
                 "None unless a layer_types entry is 'sliding'")

    def _check_layers(self) -> None:
        """`layers` stored as a tuple, empty or one entry per layer. (What each entry may be is
        `jaxformer.layers.layer_specs`' to check: this module sits below the layer kinds.)"""
        _require(self, isinstance(self.layers, (tuple, list)), "layers", "a tuple of LayerSpecs, one per layer")
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.layers and len(self.layers) != self.n_layer:  # (the specs' text would bury the count)
            raise ValueError(f"DecoderConfig.layers must be () or {self.n_layer} (n_layer) LayerSpecs, one per "
                             f"layer (got {len(self.layers)})")

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention type: `layer_types`, or "full" for every layer when it is None."""
        return ("full",) * self.n_layer if self.layer_types is None else self.layer_types

    @property
    def head_dim(self) -> int:
        """Channels per attention head: `head_dim_override`, else `d_model // n_head`."""
        return self.head_dim_override or self.d_model // self.n_head

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window, None for a full layer: its filled spec's (`layers`, whose
        mixers `jaxformer.layers.layer_specs` checks), else `sliding_window` where `attention_types`
        says "sliding" (what `layer_specs` derives)."""
        if self.layers:
            return tuple(spec.mixer.window for spec in self.layers)
        return tuple(None if kind == "full" else self.sliding_window for kind in self.attention_types)

    @property
    def cache_entries(self) -> tuple[tuple[str, tuple[tuple[int, ...], tuple[int, ...]]], ...]:
        """What each layer keeps per row between calls, `(kind, shapes)` (`jaxformer.cache.Entry`):
        its filled spec's mixer's `cache_entry`, else a key and a value of `[n_kv_head, head_dim]` a
        slot of its attention type."""
        if self.layers:
            return tuple(spec.mixer.cache_entry for spec in self.layers)
        return tuple((kind, ((self.n_kv_head, self.head_dim),) * 2) for kind in self.attention_types)

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden width: `d_ff`, or `swiglu_hidden_dim(d_model)` when it is None."""
        return self.d_ff if self.d_ff is not None else swiglu_hidden_dim(self.d_model)

    @property
    def n_rep(self) -> int:
        """Query heads per kv head."""
        return self.n_head // self.n_kv_head


@dataclasses.dataclass(frozen=True)
class VanillaConfig(_ModelConfig):
    """The 2017 encoder-decoder ("Attention Is All You Need"); defaults are the paper's base model.

    Attributes:
      src_vocab_size: source token ids are `0 .. src_vocab_size - 1`.
      tgt_vocab_size: target token ids are `0 .. tgt_vocab_size - 1`.
      n_layer: encoder layers, and as many decoder layers (the paper's N).
      d_model: model width; each of the `n_head` heads has `d_model // n_head` channels.
      d_ff: hidden width of the ReLU feed-forward network.
      n_head: attention heads (each with its own K and V).
      dropout: rate on every sublayer output, on embeddings + positions, on attention
        weights and inside the FFN.
      pad_id: the padding id, masked out as a key and ignored by the loss.
      max_seq_len: longest source or target sequence (length of the sinusoid table).
      norm_first: False for the paper's post-norm `LayerNorm(x + Dropout(Sublayer(x)))`;
        True for pre-norm `x + Dropout(Sublayer(LayerNorm(x)))`.
      final_norm: a LayerNorm after the last encoder and decoder layers (torch's
        `nn.Transformer` has both); None means `norm_first`, as pre-norm needs it and the
        paper has none. The resolved choice is `has_final_norm`.
      tie_embeddings: source and target embeddings and the output projection share one
        matrix (section 3.4); needs equal vocabularies.
      norm_eps: LayerNorm epsilon (PyTorch's default).
      dtype: activation and compute dtype.
      param_dtype: storage dtype of the parameters.
      cache_dtype: storage dtype of the decoder's KV cache; None means `dtype`.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    n_layer: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_head: int = 8
    dropout: float = 0.1
    pad_id: int = 0
    max_seq_len: int = 512
    norm_first: bool = False
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    dtype: Any = jnp.float32
    final_norm: bool | None = None
    param_dtype: Any = jnp.float32
    cache_dtype: Any = None

    def __post_init__(self):
        # Each field's kind first: the rules between fields below compare plain numbers.
        _check(self, as_int, "src_vocab_size", "tgt_vocab_size", "n_layer", "d_model", "d_ff", "n_head",
               "max_seq_len", minimum=1)
        vocab = min(self.src_vocab_size, self.tgt_vocab_size)
        _check(self, as_int, "pad_id", minimum=0)
        _require(self, self.pad_id < vocab, "pad_id", f"an id below min(src_vocab_size, tgt_vocab_size)={vocab}")
        _check(self, as_float, "dropout", at_least=0, below=1)
        _check(self, as_float, "norm_eps", above=0)
        _check(self, as_bool, "norm_first", "tie_embeddings")
        _check(self, as_bool, "final_norm", optional=True)
        self._normalise_dtypes()
        _require(self, self.d_model % self.n_head == 0, "d_model", f"divisible by n_head={self.n_head}")
        _require(self, self.d_model % 2 == 0, "d_model", "even (sin and cos channel pairs)")
        _require(self, not self.tie_embeddings or self.src_vocab_size == self.tgt_vocab_size, "tie_embeddings",
                 f"False unless src_vocab_size == tgt_vocab_size ({self.src_vocab_size} != {self.tgt_vocab_size})")

    @property
    def has_final_norm(self) -> bool:
        """Whether each stack ends in a LayerNorm (`final_norm`, or `norm_first` when None)."""
        return self.norm_first if self.final_norm is None else self.final_norm

    @property
    def ffn_dim(self) -> int:
        """The FFN's hidden width (`d_ff`), read by the same name as `DecoderConfig.ffn_dim`."""
        return self.d_ff

