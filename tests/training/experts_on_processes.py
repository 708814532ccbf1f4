"""Expert parallelism over the processes of a run, run by `tests/training/test_processes.py` in
each process (and `python tests/training/experts_on_processes.py OUT MESH...` by hand).

A decoder whose every feed-forward is a mixture of 8 experts: on each mesh named (`"data=2,expert=4"`,
...; `strategy:` before it for "fsdp"), its logits and one train step, against the same on this
process's first device alone. Process 0 writes every result to OUT (`.npz`), gathered to it.
"""

import dataclasses
import sys

from jaxformer.runtime import initialize_distributed

initialize_distributed("experts_on_processes")  # before anything touches a device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxformer import Decoder, DecoderConfig, label_smoothed_cross_entropy  # noqa: E402
from jaxformer.experts import ExpertsSpec  # noqa: E402
from jaxformer.layers import layer_specs  # noqa: E402
from jaxformer.runtime import is_primary  # noqa: E402
from jaxformer.sharding import (  # noqa: E402
    batch_sharding,
    check_mesh_fits,
    make_mesh,
    param_axes,
    parse_mesh,
    put,
    to_host,
    tree_shardings,
)
from jaxformer.training import TrainState, make_train_step  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

DENSE = DecoderConfig(vocab_size=64, n_layer=2, n_head=8, n_kv_head=2, d_model=64, max_seq_len=32,
                      tie_embeddings=False)
MOE = DENSE.replace(layers=tuple(dataclasses.replace(spec, ffn=ExpertsSpec(8, 2, 32)) for spec in layer_specs(DENSE)))
OPTIMIZER = optax.adam(1e-2, eps=1e-3)  # as tests/sharding/eight_devices.py: float noise stays noise


def main(out: str, meshes: list[str]) -> None:
    model = Decoder(MOE)
    axes = param_axes(model)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]  # the same on each
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, MOE.vocab_size)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    def logits_of(params, tokens):
        return model.apply({"params": params}, tokens)[0]

    def loss_fn(params, batch, dropout_key):
        return label_smoothed_cross_entropy(logits_of(params, batch["tokens"]), batch["targets"], 0.0), {}

    shapes = jax.eval_shape(lambda params: TrainState.create(params, OPTIMIZER), params)
    fresh = TrainState.create(jax.tree.map(jnp.copy, params), OPTIMIZER)  # (the step donates it)
    one_state, one_metrics = make_train_step(loss_fn, OPTIMIZER)(fresh, batch, jax.random.key(2))
    results = {"one/logits": jax.jit(logits_of)(params, batch["tokens"]), "one/loss": one_metrics["loss"],
               **{f"one/params{jax.tree_util.keystr(path)}": leaf
                  for path, leaf in jax.tree_util.tree_leaves_with_path(one_state.params)}}
    for name in meshes:
        strategy, _, sizes = name.rpartition(":")
        mesh = make_mesh(**parse_mesh(sizes))
        check_mesh_fits(MOE, mesh)
        shardings = tree_shardings(shapes, axes, mesh, strategy or "dp")
        placed = put(TrainState.create(params, OPTIMIZER), shardings)
        w_gate = placed.params["block_0"]["mlp"]["w_gate"]
        assert w_gate.sharding.spec[0] == "expert", w_gate.sharding.spec  # split over the experts' axis
        rows = put(batch, batch_sharding(mesh))
        with jax.set_mesh(mesh):
            results[f"{name}/logits"] = jax.jit(logits_of)(placed.params, rows["tokens"])
        stepped, metrics = make_train_step(loss_fn, OPTIMIZER, shardings)(placed, rows, jax.random.key(2))
        results[f"{name}/loss"] = metrics["loss"]
        results.update({f"{name}/params{jax.tree_util.keystr(path)}": leaf
                        for path, leaf in jax.tree_util.tree_leaves_with_path(stepped.params)})
    results = to_host(results)  # every process gathers; process 0 writes
    if is_primary():
        np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
