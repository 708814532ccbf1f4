"""A mixture of experts' compute a token against its active parameters, from XLA's cost analysis
of the compiled programs (nothing is run: the parameters are shapes).

    python -m benchmarks.moe_flops [--layers 16] [--tokens 1 4] [--out moe_flops.json]

On the OLMoE-1B-7B shape (`benchmarks.olmoe_7b.CONFIG`: 6.92 B parameters, 1.28 B active a token):
the forward of `--tokens` new tokens per call, float32, each compiled alone, its FLOPs as XLA
counts them, over `2 x active parameters x tokens` (a multiply and an add per weight a token
reads; the embedding is a lookup, not a product, so it is not counted among them). Attention's
own products (scores and values over the few positions) come on top. Dropless, the experts'
products are grouped by expert and cost what the chosen experts cost: the ratio stays near
1, where computing every expert would be `parameters / active`, about 5.4.

A few tokens a call, one position a row, as a decoding step has: XLA's cost analysis counts a
loop's body once, and `jaxformer.grouped` unrolls a decoding step's loop over blocks for up to
`grouped.UNROLLED_BLOCKS` blocks, so these calls' every block is counted; with one row a block
(`grouped.block_size`) every block is a pair, none padding.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.olmoe_7b import CONFIG, parameters
from jaxformer import Decoder
from jaxformer.convert import config_from_hf
from jaxformer.kernels import cpu


def flops(config, tokens: int) -> float:
    """XLA's count of the FLOPs of one forward of `tokens` tokens, one position in each of `tokens` rows: a
    decoding step's (its blocks unrolled, each counted)."""
    model = Decoder(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    forward = jax.jit(lambda params, ids: model.apply({"params": params}, ids)[0])
    with cpu.disabled():  # (XLA counts no custom call's arithmetic: its own products, to be counted)
        compiled = forward.lower(shapes, jax.ShapeDtypeStruct((tokens, 1), jnp.int32)).compile()
    return float(compiled.cost_analysis()["flops"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_flops", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", default="moe_flops.json")
    args = p.parse_args(argv)
    hf = dict(CONFIG, num_hidden_layers=args.layers)
    config = config_from_hf(hf, max_seq_len=64)
    total, active = parameters(hf)
    embedding = CONFIG["vocab_size"] * CONFIG["hidden_size"]  # a lookup: no multiply-add
    rows = []
    for tokens in args.tokens:
        counted = flops(config, tokens)
        ideal = 2 * (active - embedding) * tokens
        rows.append({"tokens": tokens, "flops": counted, "two_x_active": ideal, "ratio": counted / ideal,
                     "every_expert_ratio": (total - embedding) / (active - embedding)})
        print(f"{tokens} token(s): XLA counts {counted / 1e9:.2f} GFLOP, 2 x active parameters = {ideal / 1e9:.2f} "
              f"GFLOP: {counted / ideal:.3f}x (every expert would be {rows[-1]['every_expert_ratio']:.2f}x)")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "parameters": total, "active": active, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
