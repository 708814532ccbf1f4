"""A gated MLP and a mixture of experts side by side in one layer (Gemma 4's MoE layers): the
"dense and experts" feed-forward kind.

    y = norm_1(mlp(norm(x))) + norm_2(experts(norm_e(x), routed on x))

`norm(x)` is the layer's own norm before its feed-forward (`mlp_norm`, the `Block`'s); the
experts read the stream `x` through a norm of their own, and the router reads `x` itself
(through its weightless norm and scale, `ExpertsSpec.router_norm`). The block's norm after the
feed-forward then takes the sum. LoRA's adapters nest as the parameters do: the MLP's targets
(`gate_proj`, ...) adapt `dense`, the experts' parameters `experts` (`jaxformer.lora.adapter_part`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax

from jaxformer.experts import Experts, ExpertsSpec
from jaxformer.feedforward import GatedMLP, GatedMLPSpec
from jaxformer.norms import rms_norm
from jaxformer.sharding import Weight


@dataclasses.dataclass(frozen=True)
class DenseAndExpertsSpec:
    """A gated MLP (`dense`) and a mixture of experts (`experts`) summed, each normalised on its
    way out, the experts on their way in too (the module's docstring).

    Attributes:
      dense: the gated MLP's spec.
      experts: the mixture's spec.
    """

    dense: GatedMLPSpec
    experts: ExpertsSpec
    reads_stream: ClassVar[bool] = True  # its module takes the layer's stream besides its normalised input

    def build(self, config, name: str) -> "DenseAndExperts":
        """The module of a layer of this spec, named `name` in its block."""
        return DenseAndExperts(config, self, name=name)

    def weights(self, d_model: int) -> dict[str, Weight]:
        """Its own parameters: none (its parts' are `dense.weights` under `dense`, `experts.weights`
        under `experts`, and the norms')."""
        return {}

    @property
    def n_experts(self) -> int:
        """The mixture's experts (what a mesh's expert axis must divide)."""
        return self.experts.n_experts


class DenseAndExperts(nn.Module):
    """A feed-forward of kind `DenseAndExpertsSpec`: `(normed [batch, T, d_model], x [batch, T,
    d_model]) -> [batch, T, d_model]`, `normed` the block's norm of the stream `x`.

    Attributes:
      config: the model's `DecoderConfig`.
      spec: this layer's `DenseAndExpertsSpec`.
    """

    config: "DecoderConfig"  # noqa: F821
    spec: DenseAndExpertsSpec

    @nn.compact
    def __call__(self, normed: jax.Array, x: jax.Array) -> jax.Array:
        c, s = self.config, self.spec
        dense = rms_norm(c, name="dense_post_norm")(GatedMLP(c, s.dense, name="dense")(normed))
        experts = Experts(c, s.experts, beside_mlp=True, name="experts")(rms_norm(c, name="experts_norm")(x),
                                                                         router_input=x)
        return dense + rms_norm(c, name="experts_post_norm")(experts)  # [batch, T, d_model]
