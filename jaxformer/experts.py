"""A mixture of experts: the "experts" feed-forward kind of a decoder layer.

    logits = x W_router                      [N, E], one score per expert for each token
    ids, g = route(logits)                   [N, k], each token's k experts and their weights
    y      = sum_c g[:, c] * FFN_{ids[:, c]}(x)   + shared(x)

Each expert is the family's gated MLP, its weights stored stacked, `w_gate, w_up [E, d, F]` and
`w_down [E, F, d]`. A token runs through its k experts alone: the (token, choice) pairs are
sorted by expert into one grouped product (`jaxformer.grouped`), so the work and the weight
bytes read grow with the experts chosen, not with `E`, and no token is dropped. A capacity
(`ExpertsSpec.capacity_factor`) instead gives each expert a fixed number of rows, for static-shape
training: what overflows is dropped, and counted.

The routing rules, each as its family defines it (`ROUTINGS`):

    softmax_topk     p = softmax(logits); the k largest; renormalised to sum 1 or not
                     (Qwen3-MoE, Mixtral: yes; OLMoE, Qwen2-MoE: no)
    topk_softmax     the k largest logits, then a softmax over those k (gpt-oss)
    sigmoid_grouped  s = sigmoid(logits); experts chosen by s + a correction bias, within the
                     `topk_group` groups (of `n_group`) whose two best sum highest; weights from
                     s, renormalised or not, times `routed_scale` (DeepSeek-V3, Kimi K2)

Equal scores resolve as `jax.lax.top_k` does: the lower expert index first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxformer.feedforward import GATES, GatedMLP, GatedMLPSpec
from jaxformer.grouped import (
    KERNEL_PRODUCTS,
    PRODUCTS,
    block_size,
    device_products,
    dispatch,
    gather_rows,
    row_experts,
    scatter_rows,
)
from jaxformer.lora import experts_adapters
from jaxformer.norms import RMSNorm
from jaxformer.products import product
from jaxformer.quantized import QArray
from jaxformer.sharding import DATA, EMBED, EXPERT, EXPERTS, MLP, ROUTES, Weight, compute_param

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")
ACTIVATIONS = (*GATES, "clamped_swiglu")  # the experts' gate: the dense MLP's, or gpt-oss's clamped SwiGLU
ROUTER_COLLECTION = "router"  # where each layer sows its router's logits and its capacity's drops


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """The "experts" feed-forward kind: a router and `n_experts` gated MLPs, `top_k` per token.

    Attributes:
      n_experts: E, the routed experts.
      top_k: k, the experts each token runs through, `1 <= k <= E`.
      width: each expert's hidden width (`moe_intermediate_size`).
      activation: the gate's nonlinearity, one of `ACTIVATIONS`: "silu", "gelu_tanh", or
        "clamped_swiglu" (gpt-oss: `(clip(up) + 1) * g sigmoid(alpha g)`, g the gate clipped above).
      routing: one of `ROUTINGS` (the module's docstring).
      normalize: the k weights renormalised to sum 1 (`norm_topk_prob`; softmax_topk and sigmoid_grouped).
      router_bias: the router adds a bias per expert (gpt-oss).
      expert_bias: each expert's three products add a bias (gpt-oss).
      swiglu_limit, swiglu_alpha: "clamped_swiglu"'s clip and the sigmoid's slope.
      n_group, topk_group: sigmoid_grouped: the experts in `n_group` equal groups, the choice
        within the best `topk_group`.
      routed_scale: sigmoid_grouped: the weights' factor (`routed_scaling_factor`).
      shared_width: a shared expert's hidden width, a gated MLP every token runs through
        besides its k (Qwen2-MoE, DeepSeek); None: none.
      shared_gate: the shared expert's output scaled by `sigmoid(x w_shared_gate)` (Qwen2-MoE).
      capacity_factor: None (dropless, the default); else each expert takes at most
        `ceil(capacity_factor * N * k / E)` of a call's N tokens' pairs, the rest dropped.
      aux_loss_coef: the weight of the router's load-balancing loss in training
        (`router_aux_loss_coef`; `load_balancing_loss`).
      router_norm: the router reads its input through an RMSNorm without a weight, times a
        learned scale per channel (`router_scale`) and `d_model ** -0.5` (Gemma 4).
      expert_scale: each chosen expert's weight, after routing, times a learned scale of that
        expert (`expert_scale`, Gemma 4's `per_expert_scale`).
    """

    n_experts: int
    top_k: int
    width: int
    activation: str = "silu"
    routing: str = "softmax_topk"
    normalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    shared_width: int | None = None
    shared_gate: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.001
    router_norm: bool = False
    expert_scale: bool = False

    def __post_init__(self):
        def need(ok: bool, field: str, rule: str):
            if not ok:
                raise ValueError(f"ExpertsSpec.{field} must be {rule} (got {getattr(self, field)!r})")

        for field in ("n_experts", "top_k", "width", "n_group", "topk_group"):
            need(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "an int >= 1")
        need(self.top_k <= self.n_experts, "top_k", f"at most n_experts={self.n_experts}")
        need(self.activation in ACTIVATIONS, "activation", f"one of {ACTIVATIONS}")
        need(self.routing in ROUTINGS, "routing", f"one of {ROUTINGS}")
        clamped = self.activation == "clamped_swiglu"
        for field in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, field)
            need((value is not None and value > 0) if clamped else value is None, field,
                 "a number > 0" if clamped else "None unless activation='clamped_swiglu'")
        grouped_routing = self.routing == "sigmoid_grouped"
        need(self.n_experts % self.n_group == 0 and (self.n_group == 1 or grouped_routing), "n_group",
             f"a divisor of n_experts={self.n_experts} (other than 1 only with routing='sigmoid_grouped')")
        need(self.topk_group <= self.n_group, "topk_group", f"at most n_group={self.n_group}")
        need(not grouped_routing or self.n_experts // self.n_group >= 2, "n_group",
             "such that each group holds 2 experts or more (a group scores by its best two)")
        need(self.top_k <= self.topk_group * self.n_experts // self.n_group, "top_k",
             "at most the experts of topk_group groups")
        need(self.routed_scale > 0 and (self.routed_scale == 1.0 or grouped_routing), "routed_scale",
             "> 0 (other than 1 only with routing='sigmoid_grouped')")
        need(self.shared_width is None or (isinstance(self.shared_width, int) and self.shared_width >= 1),
             "shared_width", "None or an int >= 1")
        need(self.shared_width is None or self.activation in GATES, "shared_width",
             f"None with activation={self.activation!r} (a shared expert is a gated MLP of {tuple(GATES)})")
        need(not self.shared_gate or self.shared_width is not None, "shared_gate", "False without a shared expert")
        need(self.capacity_factor is None or self.capacity_factor > 0, "capacity_factor", "None or a number > 0")
        need(self.aux_loss_coef >= 0, "aux_loss_coef", "a number >= 0")

    def build(self, config, name: str) -> "Experts":
        """The module of a layer of this spec, named `name` in its block."""
        return Experts(config, self, name=name)

    def weights(self, d_model: int) -> dict[str, Weight]:
        """The router's and the experts' parameters, by name (as `AttentionSpec.weights`); the
        shared expert's are `shared_weights`'."""
        E, F = self.n_experts, self.width
        weights = {"router": Weight((d_model, E), (EMBED, ROUTES)),
                   "w_gate": Weight((E, d_model, F), (EXPERTS, EMBED, MLP), inputs=2),
                   "w_up": Weight((E, d_model, F), (EXPERTS, EMBED, MLP), inputs=2),
                   "w_down": Weight((E, F, d_model), (EXPERTS, MLP, EMBED), inputs=2)}
        if self.router_bias:
            weights["router_bias"] = Weight((E,), (ROUTES,), inputs=0)
        if self.routing == "sigmoid_grouped":  # used to choose, never to weigh
            weights["correction_bias"] = Weight((E,), (ROUTES,), inputs=0)
        if self.expert_bias:
            weights.update(b_gate=Weight((E, F), (EXPERTS, MLP), inputs=1),
                           b_up=Weight((E, F), (EXPERTS, MLP), inputs=1),
                           b_down=Weight((E, d_model), (EXPERTS, EMBED), inputs=1))
        if self.shared_gate:
            weights["shared_gate"] = Weight((d_model, 1), (EMBED, ROUTES))
        if self.router_norm:
            weights["router_scale"] = Weight((d_model,), (EMBED,), inputs=0)
        if self.expert_scale:
            weights["expert_scale"] = Weight((E,), (ROUTES,), inputs=0)
        return weights

    @property
    def shared(self) -> GatedMLPSpec | None:
        """The shared expert's spec, or None."""
        return None if self.shared_width is None else GatedMLPSpec(self.shared_width, self.activation)


def route(logits: jax.Array, spec: ExpertsSpec, correction_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and their weights: `(weights float32 [N, k], ids int32 [N, k])` from the
    router's float32 `logits [N, E]`, by `spec.routing` (the module's docstring); `correction_bias`
    `[E]`, sigmoid_grouped's, shifts the choice and not the weights."""
    k = spec.top_k
    if spec.routing == "topk_softmax":  # the k largest logits, a softmax over them alone
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids
    if spec.routing == "softmax_topk":
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        return (weights / weights.sum(-1, keepdims=True) if spec.normalize else weights), ids
    scores = jax.nn.sigmoid(logits)  # [N, E]
    choice = scores + correction_bias  # chooses; the weights stay `scores`
    n, E = logits.shape
    groups = choice.reshape(n, spec.n_group, E // spec.n_group)  # [N, n_group, E / n_group]
    group_score = jax.lax.top_k(groups, 2)[0].sum(-1)  # [N, n_group], each group's best two
    kept = jax.lax.top_k(group_score, spec.topk_group)[1]  # [N, topk_group]
    in_kept = jnp.zeros((n, spec.n_group), bool).at[jnp.arange(n)[:, None], kept].set(True)
    choice = jnp.where(jnp.repeat(in_kept, E // spec.n_group, axis=1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, k)[1]  # [N, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if spec.normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * spec.routed_scale, ids


def expert_gate(spec: ExpertsSpec, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' hidden layer from the gate's and up's products: `act(gate) * up`, or
    gpt-oss's clamped SwiGLU `(clip(up, -L, L) + 1) * g sigmoid(alpha g)`, `g = min(gate, L)`."""
    if spec.activation != "clamped_swiglu":
        return GATES[spec.activation](gate) * up
    limit = spec.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * spec.swiglu_alpha))


def capacity(spec: ExpertsSpec, n_tokens: int) -> int:
    """The rows each expert takes with `spec.capacity_factor`: `ceil(factor * N * k / E)`."""
    return math.ceil(spec.capacity_factor * n_tokens * spec.top_k / spec.n_experts)


def routed(spec: ExpertsSpec, tokens: jax.Array, ids: jax.Array, gates: jax.Array, w: dict,
           adapters: dict | None = None, *, how: str, block: int, capacity: int | None
           ) -> tuple[jax.Array, jax.Array]:
    """`(y [N, d_model], dropped int32 [])`: `sum_c gates[:, c] * FFN_{ids[:, c]}(tokens)`, the pairs
    laid out by `grouped.dispatch` and each of the experts' three products one grouped product
    (`PRODUCTS[how]`); `w` the layer's parameters by name. `adapters`, LoRA's on the experts
    (`jaxformer.lora.experts_adapters`: `{"gate_up" or "down": (a [E, n_in, r], b [E, r, n_out])}`,
    `b` scaled), add `(x a[e]) b[e]` to gate and up (`b`'s columns the gate's then up's) or to
    down, each two more grouped products of the same rows. Under expert parallelism `w` (and the
    adapters) hold one device's experts and `ids` count from its first, an id past its last a
    pair it does not run."""
    layout = dispatch(ids, w["w_up"].shape[0], block, capacity)  # the experts `w` holds: all, or a device's share
    multiply = PRODUCTS[how]
    adapters = adapters or {}

    # (The Pallas kernels take the experts' widths, not an adapter's rank: its products are ragged_dot's there.)
    adapt = PRODUCTS["ragged"] if how in KERNEL_PRODUCTS else multiply

    def low_rank(x, name):  # [rows, n_out]: each row through its expert's adapter
        a, b = adapters[name]
        return adapt(adapt(x, a, layout), b, layout)

    rows = gather_rows(tokens, layout, spec.top_k)  # [rows, d_model]
    gate, up = multiply(rows, w["w_gate"], layout), multiply(rows, w["w_up"], layout)  # [rows, F]
    if "gate_up" in adapters:
        delta = low_rank(rows, "gate_up")  # [rows, 2F]
        gate, up = gate + delta[:, :spec.width], up + delta[:, spec.width:]
    if spec.expert_bias:  # each row its expert's bias (none past the last group: those rows are never read)
        expert = row_experts(layout)

        def bias(name):
            return jnp.take(w[name], expert, axis=0, mode="fill", fill_value=0)

        gate, up = gate + bias("b_gate"), up + bias("b_up")
    hidden = expert_gate(spec, gate, up)  # [rows, F]
    y = multiply(hidden, w["w_down"], layout)  # [rows, d_model]
    if "down" in adapters:
        y = y + low_rank(hidden, "down")
    if spec.expert_bias:
        y = y + bias("b_down")
    pairs = scatter_rows(y, layout, ids.shape)  # [N, k, d_model]
    out = jnp.einsum("nkd,nk->nd", pairs, gates, preferred_element_type=jnp.float32)  # the weighted sum
    return out.astype(tokens.dtype), layout.dropped


def expert_mesh(n_experts: int):
    """The mesh to split `n_experts` experts over: the context's (`jax.set_mesh(mesh)`, or the mesh
    `make_train_step` traces its step on) where it has an `expert` axis that divides them, else
    None. (Its `Auto` axes leave nothing of the placement in the arrays a program traces, so the
    mesh is read from the context.)"""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT not in mesh.axis_names or n_experts % mesh.shape[EXPERT]:
        return None
    return mesh


def expert_parallel(grouped, mesh, tokens: jax.Array, ids: jax.Array, gates: jax.Array, w: dict, *,
                    pooled: bool) -> tuple[jax.Array, jax.Array]:
    """`grouped(tokens, ids, gates, w)` (`(y [N, d], dropped)`, the routed part of `Experts`) with
    the experts split over the mesh's `expert` axis: `n` devices along it, each holding
    `E / n` experts (`w`, each weight's first axis `EXPERTS`), the rules' placement.

    The tokens go to the experts by a gather: a device's rows are split over `data x expert`
    (as a batch is, `batch_sharding`), so along `expert`

        x   = all_gather(rows)                    the rows of this data shard, in order
        ids = e - first, or E / n where e is not  each pair's expert among this device's
              among [first, first + E / n)        (another device's pair: `dispatch` drops it)
        y_i = sum of g_c FFN_e(x) over the pairs  this device's share of each row's output
              of this device's experts
        y   = psum_scatter(y_i)                   the shares summed, each row back to its device

    Each pair is computed once, by its expert's device, and a row's output is its k pairs' sum,
    as on one device. With a capacity (`pooled`) the gather spans `data` too: which pairs an
    expert drops depends on every token of the call. Rows that do not split over the mesh (a
    few rows of decoding) stay whole on every device, and `psum` sums the shares.

    Only `data` and `expert` are manual in the `shard_map`: `model` (tensor parallelism of the
    experts' hidden units) and FSDP's gather of each expert's matrices over `data` (its
    in-spec says nothing of `data`: whole on entry) are the compiler's, as everywhere else."""
    n_data, n_expert = (dict(mesh.shape).get(axis, 1) for axis in (DATA, EXPERT))
    manual = tuple(axis for axis in (DATA, EXPERT) if axis in mesh.axis_names)
    split = tokens.shape[0] % (n_data * n_expert) == 0  # rows over data x expert, or whole
    rows = P(manual) if split else P()
    local = w["w_up"].shape[0] // n_expert

    def body(tokens, ids, gates, w):
        if split:  # this data shard's rows (every data shard's, pooled), in order
            tokens, ids, gates = (jax.lax.all_gather(a, EXPERT, tiled=True) for a in (tokens, ids, gates))
            if pooled and DATA in manual:
                tokens, ids, gates = (jax.lax.all_gather(a, DATA, tiled=True) for a in (tokens, ids, gates))
        first = jax.lax.axis_index(EXPERT) * local
        ours = (ids >= first) & (ids < first + local)
        y, dropped = grouped(tokens, ids=jnp.where(ours, ids - first, local), gates=gates, w=w)
        dropped = jax.lax.psum(dropped, EXPERT)  # each expert's drops, counted on its device
        if not split:
            return jax.lax.psum(y, EXPERT), dropped
        if pooled and DATA in manual:  # the shares of this data shard's rows (the same on every data shard)
            y = jax.lax.dynamic_index_in_dim(y.reshape(n_data, -1, y.shape[-1]), jax.lax.axis_index(DATA),
                                             keepdims=False)
        return jax.lax.psum_scatter(y, EXPERT, scatter_dimension=0, tiled=True), dropped

    specs = {name: P(EXPERT) for name in w}
    # (check_vma=False: the blocked product's `cond`, an expert's product or zeros, has branches of
    # unequal varying-ness to shard_map's type check; every output here is as its spec says.)
    run = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, specs), out_specs=(rows, P()),
                        axis_names=set(manual), check_vma=False)
    return run(tokens, ids, gates, w)


class Experts(nn.Module):
    """A mixture of experts (a feed-forward of kind `ExpertsSpec`): each token through its k
    routed experts, weighted, plus a shared expert where the spec has one.

    The router's logits `[batch, T, E]` (float32) are sown into the `ROUTER_COLLECTION` as
    `logits`, what the load-balancing loss reads (`load_balancing_loss`), and with a capacity
    the pairs it dropped as `dropped`: each a no-op unless that collection is mutable.

    Attributes:
      config: the model's `DecoderConfig` (`d_model`, `n_layer`, LoRA, dtypes).
      spec: this layer's `ExpertsSpec`.
      beside_mlp: whether a gated MLP sits beside it (`jaxformer.dense_experts`, Gemma 4's), which
        the MLP's LoRA targets (`gate_proj`, ...) adapt.
    """

    config: "DecoderConfig"  # noqa: F821
    spec: ExpertsSpec
    beside_mlp: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, router_input: jax.Array | None = None) -> jax.Array:
        """`[batch, T, d_model]`: each token of `x` `[batch, T, d_model]` through its experts, chosen
        by the router from `router_input` (Gemma 4's reads the stream, the experts a norm of it;
        None: `x`)."""
        c, s = self.config, self.spec
        if c.lora is not None and c.lora.matrices & {"w_gate", "w_up", "w_down"} and not self.beside_mlp:
            raise ValueError(f"LoraConfig.targets={c.lora.targets}: the MLP's projections are experts in this layer; "
                             "adapt the attention's (q_proj, k_proj, v_proj, o_proj) or the experts' matrices "
                             "(mlp.experts.gate_up_proj, mlp.experts.down_proj)")
        declared = s.weights(c.d_model)
        init = nn.initializers.normal(0.02)
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))  # see GQASelfAttention
        inits = {"w_down": residual_init, "router_bias": nn.initializers.zeros,
                 "correction_bias": nn.initializers.zeros, "b_gate": nn.initializers.zeros,
                 "b_up": nn.initializers.zeros, "b_down": nn.initializers.zeros,
                 "router_scale": nn.initializers.ones, "expert_scale": nn.initializers.ones}
        w = {name: compute_param(self, name, inits.get(name, init), *declared[name][:2]) for name in declared}

        batch, T, d = x.shape
        tokens = x.reshape(batch * T, d)  # [N, d_model]
        routed_on = tokens if router_input is None else router_input.reshape(batch * T, d)
        if s.router_norm:  # Gemma 4's: a weightless norm, a scale per channel, and 1/sqrt(d), in the compute dtype
            routed_on = RMSNorm(c.norm_eps, scaled=False)(routed_on) * w["router_scale"]
            routed_on = (routed_on.astype(jnp.float32) * jnp.float32(d ** -0.5)).astype(x.dtype)
        logits = product("nd,de->ne", routed_on, w["router"])  # [N, E] in the compute dtype, as the families' routers
        if s.router_bias:
            logits = logits + w["router_bias"]
        logits = logits.astype(jnp.float32)
        self.sow(ROUTER_COLLECTION, "logits", logits.reshape(batch, T, -1))
        gates, ids = route(logits, s, w.get("correction_bias"))
        if s.expert_scale:  # Gemma 4's: each chosen expert's own scale, on the routed weights
            gates = gates * jnp.take(w["expert_scale"].astype(jnp.float32), ids)
        gates = gates.astype(x.dtype)  # the weights in the compute dtype, as the families apply them

        N = batch * T
        limit = None if s.capacity_factor is None else capacity(s, N)

        def grouped(tokens, ids, gates, w):  # (y, dropped) of the pairs (ids, gates) of `tokens`
            weights, adapters = {k: v for k, v in w.items() if k != "adapters"}, w.get("adapters")
            run = functools.partial(routed, s, how="unrolled" if T == 1 else "in_blocks", capacity=limit,
                                    block=limit or block_size(ids.size, s.n_experts))
            # A CPU multiplies block by block (a decoding step's few blocks unrolled); a GPU or TPU with the
            # Pallas kernels where they take the shapes, else with ragged_dot (`grouped.device_products`).
            return jax.lax.platform_dependent(
                tokens, ids, gates, weights, adapters, cpu=run,
                **{platform: functools.partial(run, **options) for platform, options in
                   device_products(d, s.width, x.dtype, ids.size, s.n_experts, limit,
                                   quantized=isinstance(weights["w_up"], QArray)).items()})

        adapters = experts_adapters(self, tokens.dtype)  # LoRA's on the experts' matrices, or None
        w = w if adapters is None else {**w, "adapters": adapters}
        mesh = expert_mesh(s.n_experts)
        if mesh is None:
            y, dropped = grouped(tokens, ids, gates, w)
        else:  # each device runs the pairs of its own experts (`expert_parallel`), their adapters too
            local = {name: w[name] for name, weight in declared.items() if weight.axes[0] == EXPERTS}
            if adapters is not None:
                local["adapters"] = adapters  # (each [E, ...]: split along the experts too)
            y, dropped = expert_parallel(grouped, mesh, tokens, ids, gates, local, pooled=limit is not None)
        if limit is not None:
            self.sow(ROUTER_COLLECTION, "dropped", dropped)
        y = y.reshape(batch, T, d)
        if s.shared is not None:  # every token through the shared expert too, gated (Qwen2-MoE) or not
            shared = GatedMLP(c, s.shared, name="shared")(x)
            if s.shared_gate:
                shared = shared * jax.nn.sigmoid(product("btd,do->bto", x, w["shared_gate"]))
            y = y + shared
        return y  # [batch, T, d_model]


def load_balancing_loss(logits: list[jax.Array], top_k: int, mask: jax.Array | None = None) -> jax.Array:
    """The router's auxiliary loss as transformers computes it (`load_balancing_loss_func`):
    over every layer's router `logits` (each float32 `[batch, T, E]`) and the tokens `mask`
    keeps (bool `[batch, T]`, None: all),

        f_e = (pairs routed to e) / tokens,   P_e = (sum of softmax probabilities of e) / tokens
        loss = E * sum_e f_e P_e

    each a mean over every layer's tokens; routed by the softmax's top k whatever the layer's own
    routing. It is smallest, `k`, when every expert gets an equal share."""
    E = logits[0].shape[-1]
    keep = jnp.ones(logits[0].shape[:2], jnp.float32) if mask is None else mask.astype(jnp.float32)
    counts, probs = jnp.zeros(E), jnp.zeros(E)
    for layer in logits:
        p = jax.nn.softmax(layer.astype(jnp.float32), axis=-1)  # [batch, T, E]
        chosen = jax.nn.one_hot(jax.lax.top_k(p, top_k)[1], E).sum(-2)  # [batch, T, E], k ones a token
        counts = counts + jnp.einsum("bte,bt->e", chosen, keep)
        probs = probs + jnp.einsum("bte,bt->e", p, keep)
    rows = keep.sum() * len(logits)
    return E * jnp.sum((counts / rows) * (probs / rows))


def expert_counts(logits: jax.Array, spec: ExpertsSpec, correction_bias: jax.Array | None = None,
                  mask: jax.Array | None = None) -> jax.Array:
    """int32 `[E]`: the (token, choice) pairs a layer of `spec` routes to each expert, from its
    router's float32 `logits [batch, T, E]` (what it sows) by its own rule (`route`, with its
    `correction_bias` where it has one), over the tokens `mask` keeps (bool `[batch, T]`; None: all).
    They sum to `k` times the tokens kept."""
    ids = route(logits.reshape(-1, logits.shape[-1]), spec, correction_bias)[1]  # [N, k]
    keep = jnp.ones(ids.shape[0], jnp.int32) if mask is None else mask.reshape(-1).astype(jnp.int32)
    return jnp.zeros(spec.n_experts, jnp.int32).at[ids].add(jnp.broadcast_to(keep[:, None], ids.shape))


def _sown(sown: dict, name: str) -> list[jax.Array]:
    """Every `name` entry a model sowed in the `ROUTER_COLLECTION` (`apply(..., mutable=[ROUTER_COLLECTION])`'s
    second output), in the order of its tree: a block's as sown, a scanned segment's stacked over its layers."""
    found = []

    def walk(tree):
        for key, value in tree.items():
            if key == name:
                found.append(value[0])  # (sow keeps a tuple of what was sown)
            elif isinstance(value, dict):
                walk(value)

    walk(sown.get(ROUTER_COLLECTION, {}))
    return found


def router_logits(sown: dict) -> list[jax.Array]:
    """Each layer's router logits, `[batch, T, E]` float32, from what a model sowed (`_sown`): a
    scanned segment's split along its layers' axis."""
    return [layer for stacked in _sown(sown, "logits") for layer in stacked.reshape(-1, *stacked.shape[-3:])]


def dropped_pairs(sown: dict) -> jax.Array:
    """int32 `[]`: the (token, choice) pairs every layer's capacity dropped in the call that sowed `sown`."""
    return sum((jnp.sum(d) for d in _sown(sown, "dropped")), jnp.int32(0))
