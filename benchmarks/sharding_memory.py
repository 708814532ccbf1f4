"""Per-device parameter and optimizer memory of each sharding strategy, against one device.

    python -m benchmarks.sharding_memory [--devices 8] [--out F.json]

Runs on simulated CPU devices (`--xla_force_host_platform_device_count`, set here before
JAX starts unless XLA_FLAGS already says otherwise). For both demo models and a larger
decoder, the parameters and Adam state are placed by `jaxformer.sharding`'s rules on
each mesh and the bytes held by device 0 are counted from the arrays' own shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")

    import jax
    import optax

    from jaxformer import Decoder, DecoderConfig, VanillaConfig, VanillaTransformer
    from jaxformer.sharding import make_mesh, param_axes, tree_shardings
    from jaxformer.training import TrainState

    n = jax.device_count()
    models = {
        "reverse demo (VanillaTransformer)": VanillaTransformer(VanillaConfig(
            src_vocab_size=19, tgt_vocab_size=19, n_layer=2, d_model=64, d_ff=128, n_head=4)),
        "decode benchmark decoder (30.5 M)": Decoder(DecoderConfig(
            vocab_size=8192, n_layer=8, n_head=8, n_kv_head=2, d_model=512, d_ff=1376, tie_embeddings=False)),
    }
    # Every mesh uses all n devices; "TP" keeps 4 on the model axis (the reverse demo has
    # 4 heads), with the rest on data holding copies.
    meshes = [("one device", None, None), ("DP", "dp", (n, 1)), ("FSDP", "fsdp", (n, 1)),
              ("TP", "dp", (n // 4, 4)), ("DP x TP", "dp", (n // 2, 2)), ("FSDP x TP", "fsdp", (n // 4, 4))]
    rows = []
    for model_name, model in models.items():
        params = jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"]
        state = TrainState.create(params, optax.adam(1e-3))
        axes = param_axes(model)
        for label, strategy, shape in meshes:
            if shape is not None:
                mesh = make_mesh(data=shape[0], model=shape[1])
                state_on_mesh = jax.device_put(state, tree_shardings(state, axes, mesh, strategy))
            else:
                state_on_mesh = state
            device = jax.devices()[0]

            def on_device_0(tree, device=device):
                return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
                           if shard.device == device)

            rows.append({"model": model_name, "strategy": label, "mesh": shape,
                         "params_mb": on_device_0(state_on_mesh.params) / 2 ** 20,
                         "opt_state_mb": on_device_0(state_on_mesh.opt_state) / 2 ** 20})
    print(f"{n} simulated CPU devices; bytes held by device 0")
    print(f"{'model':36s} {'strategy':10s} {'mesh':>8s} {'params MB':>10s} {'Adam MB':>9s} {'vs one device':>14s}")
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["mesh"] is None)
        mesh = "-" if r["mesh"] is None else f"{r['mesh'][0]}x{r['mesh'][1]}"
        print(f"{r['model']:36s} {r['strategy']:10s} {mesh:>8s} {r['params_mb']:10.2f} {r['opt_state_mb']:9.2f} "
              f"{(r['params_mb'] + r['opt_state_mb']) / (base['params_mb'] + base['opt_state_mb']):13.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
