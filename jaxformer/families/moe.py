"""What the mixture-of-experts families share: their experts' fields in `config.json`, each
layer's spec filled in (a layer of experts, or a dense one among them), and the experts' tensors.

A family of experts reads its attention as its dense sibling does (Qwen3-MoE as Qwen3, Mixtral
as Mistral) and fills `DecoderConfig.layers` with those layers' specs, the feed-forward of each
an `ExpertsSpec` or, where the family keeps a dense layer, a `GatedMLPSpec` of `d_ff`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jaxformer.config import DecoderConfig
from jaxformer.experts import ExpertsSpec
from jaxformer.families.common import fail, flag, linear, mlp_tensors, positive_int, vector
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import layer_specs
from jaxformer.validation import finite_float, python_int

# Each expert's three matrices by checkpoint name, the shared expert's, and the router's and
# shared gate's (after `model.layers.{i}.`), as Qwen-MoE and OLMoE name them.
QWEN_NAMES = {"router": "mlp.gate", "experts": "mlp.experts", "shared": "mlp.shared_expert",
              "shared_gate": "mlp.shared_expert_gate",
              "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def expert_count(hf: dict, *keys: str) -> int:
    """The routed experts, from the first of `keys` present (a family's config class accepts
    either name: Qwen3-MoE's `num_experts` is transformers 5's `num_local_experts`)."""
    key = next((k for k in keys if hf.get(k) is not None), keys[0])
    return positive_int(hf, key)


def read_experts(hf: dict, n_experts: int, width_key: str, *, normalize: bool, **spec) -> ExpertsSpec:
    """An `ExpertsSpec` of `n_experts` experts of width `width_key`, `num_experts_per_tok` of them a token,
    the load-balancing loss's weight (`router_aux_loss_coef`), and `spec`'s other fields."""
    top_k = positive_int(hf, "num_experts_per_tok")
    if top_k > n_experts:
        fail("num_experts_per_tok", f"must be at most the experts ({n_experts})", top_k)
    coef = hf.get("router_aux_loss_coef")
    if coef is None:
        coef = 0.001  # transformers' default
    elif finite_float(coef) is None or finite_float(coef) < 0:
        fail("router_aux_loss_coef", "must be a finite number >= 0", coef)
    return ExpertsSpec(n_experts, top_k, positive_int(hf, width_key), normalize=normalize,
                       aux_loss_coef=finite_float(coef), **spec)


def refuse_jitter(hf: dict) -> None:
    """A training-time noise on the router's input that no step here draws: refused unless 0."""
    if hf.get("router_jitter_noise") not in (None, 0, 0.0):
        fail("router_jitter_noise", "must be 0 (the router's input noise in training is not implemented)",
             hf["router_jitter_noise"])


def qwen_sparse(hf: dict, n_layer: int) -> list[bool]:
    """Which layers are experts by Qwen-MoE's rule: every `decoder_sparse_step`-th (1: all),
    but those `mlp_only_layers` lists."""
    step = positive_int(hf, "decoder_sparse_step", default=1)
    dense = hf.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(python_int(i) is not None and 0 <= python_int(i) < n_layer
                                            for i in dense)):
        fail("mlp_only_layers", f"must list layer indices in [0, {n_layer})", dense)
    return [i not in dense and (i + 1) % step == 0 for i in range(n_layer)]


def write_qwen_sparse(config: DecoderConfig) -> dict:
    """`decoder_sparse_step` 1 and the dense layers as `mlp_only_layers`."""
    return {"decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, spec in enumerate(layer_specs(config)) if isinstance(spec.ffn, GatedMLPSpec)]}


def with_experts(fields: dict, experts: ExpertsSpec, sparse: Sequence[bool]) -> dict:
    """`fields` (a family's `DecoderConfig` fields) with `layers` filled: each layer as the fields
    state it, its feed-forward `experts` where `sparse` says so."""
    derived = layer_specs(DecoderConfig(**fields))
    return dict(fields, layers=tuple(dataclasses.replace(spec, ffn=experts) if is_sparse else spec
                                     for spec, is_sparse in zip(derived, sparse)))


def experts_of(config: DecoderConfig) -> ExpertsSpec:
    """The one `ExpertsSpec` of a family's layers of experts (config.json states one for all).

    Raises:
      ValueError: none of the layers is one, or two differ.
    """
    specs = {spec.ffn for spec in layer_specs(config) if isinstance(spec.ffn, ExpertsSpec)}
    if len(specs) != 1:
        raise ValueError(f"config.layers must hold one ExpertsSpec for every layer of experts (got {len(specs)}), "
                         f"as a {config.hf_model_type} config.json states them")
    return specs.pop()


def experts_fields(config: DecoderConfig, count_key: str, width_key: str, written: Callable[[ExpertsSpec], dict]
                   ) -> dict:
    """The experts' `config.json` fields every family writes (count, k, width, the loss's weight),
    and `written(spec)`'s own."""
    spec = experts_of(config)
    return {count_key: spec.n_experts, "num_experts_per_tok": spec.top_k, width_key: spec.width,
            "router_aux_loss_coef": spec.aux_loss_coef, **written(spec)}


def experts_tensors(d_model: int, spec: ExpertsSpec, prefix: str, block: str, names: dict) -> list:
    """A layer of experts' tensors: the router `{router}.weight [E, d]` (and a sigmoid_grouped
    router's correction bias, `{router}.e_score_correction_bias [E]`, DeepSeek's name), each expert
    e's three `{experts}.{e}.{w_gate,w_up,w_down}.weight` (rows `e` of `{block}/mlp/w_*`), and a
    shared expert's `{shared}.*` with its gate `{shared_gate}.weight [1, d]`, by the family's `names`."""
    E, F, d = spec.n_experts, spec.width, d_model
    path = (block, "mlp")
    table = [linear(f"{prefix}{names['router']}.weight", (*path, "router"), (d, E), E, d)]
    if "correction_bias" in spec.weights(d):
        table.append(vector(f"{prefix}{names['router']}.e_score_correction_bias", (*path, "correction_bias"), E))
    for e in range(E):
        stem = f"{prefix}{names['experts']}.{e}."
        table += [linear(stem + names["w_gate"] + ".weight", (*path, "w_gate"), (d, F), F, d, expert=(e, E)),
                  linear(stem + names["w_up"] + ".weight", (*path, "w_up"), (d, F), F, d, expert=(e, E)),
                  linear(stem + names["w_down"] + ".weight", (*path, "w_down"), (F, d), d, F, expert=(e, E))]
    if spec.shared is not None:
        S, stem = spec.shared.width, f"{prefix}{names['shared']}."
        table += [linear(stem + "gate_proj.weight", (*path, "shared", "w_gate"), (d, S), S, d),
                  linear(stem + "up_proj.weight", (*path, "shared", "w_up"), (d, S), S, d),
                  linear(stem + "down_proj.weight", (*path, "shared", "w_down"), (S, d), d, S)]
    if spec.shared_gate:
        table.append(linear(f"{prefix}{names['shared_gate']}.weight", (*path, "shared_gate"), (d, 1), 1, d))
    return table


def ffn_tensors(d_model: int, spec, prefix: str, block: str, names: dict = QWEN_NAMES) -> list:
    """A layer's feed-forward tensors: a gated MLP's `mlp.{gate,up,down}_proj`, or a layer of experts' (`names`)."""
    if isinstance(spec, ExpertsSpec):
        return experts_tensors(d_model, spec, prefix, block, names)
    return mlp_tensors(d_model, spec, prefix, block)


def refuse_sliding_window(hf: dict) -> None:
    """For a family of experts whose window is not implemented here: `use_sliding_window` refused."""
    if flag(hf, "use_sliding_window", False):
        fail("use_sliding_window", "must be false (this family's sliding window is not implemented)", True)
