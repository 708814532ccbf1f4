"""A mixture of experts' prefill and LoRA step, jaxformer against transformers (+ peft), on one
random OLMoE-shaped checkpoint small enough for both.

    python -m benchmarks.moe_steps [--d-model 1024] [--layers 4] [--experts 64] [--width 512] [--top-k 8]
                                   [--vocab 16384] [--seq-len 512] [--steps 3] [--out moe_steps.json]

The checkpoint is made here (transformers' `OlmoeForCausalLM`, random, float32, saved with
`save_pretrained`); nothing is downloaded. Both sides run float32 on the same random ids:

- prefill: the logits of one `[1, seq_len]` call (jaxformer's jitted forward; transformers'
  under `torch.no_grad`), the median of `--steps` calls after one untimed one;
- a LoRA step: rank 8 on q, k, v and o (`benchmarks.finetune`'s step on each side: the loss,
  its gradient, AdamW), `[1, seq_len]`, the median of `--steps` steps after two untimed ones;
  the first losses must agree.

Ratios are transformers' time over jaxformer's (above 1: jaxformer is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.finetune import batch_ids, hardware, time_jax, time_torch
from benchmarks.olmoe_7b import CONFIG

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_checkpoint(path: str, args) -> None:
    import torch
    import transformers

    config = dict(CONFIG, hidden_size=args.d_model, intermediate_size=args.width, num_hidden_layers=args.layers,
                  num_attention_heads=args.d_model // 128, num_key_value_heads=args.d_model // 128,
                  num_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                  max_position_embeddings=max(args.seq_len, 4096))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    model.save_pretrained(path)


def median(times: list[float]) -> float:
    return float(np.median(times))


def prefill_jax(path: str, ids: np.ndarray, steps: int) -> float:
    import jax
    import jax.numpy as jnp

    from jaxformer import Decoder
    from jaxformer.convert import load_hf

    config, params = load_hf(path)
    forward = jax.jit(lambda params, tokens: Decoder(config).apply({"params": params}, tokens)[0])
    tokens = jnp.asarray(ids)
    forward(params, tokens).block_until_ready()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        forward(params, tokens).block_until_ready()
        times.append(time.perf_counter() - start)
    return median(times)


def prefill_torch(path: str, ids: np.ndarray, steps: int) -> float:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.tensor(ids)
    times = []
    with torch.no_grad():
        model(input_ids=tokens)
        for _ in range(steps):
            start = time.perf_counter()
            model(input_ids=tokens)
            times.append(time.perf_counter() - start)
    return median(times)


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "checkpoint")
        make_checkpoint(path, args)
        ids = batch_ids(args.vocab, 1, args.seq_len + 1)
        prefill = {"jaxformer": prefill_jax(path, ids[:, :-1], args.steps),
                   "transformers": prefill_torch(path, ids[:, :-1], args.steps)}
        (jax_times, jax_first), (torch_times, torch_first) = (
            time_jax(path, ids, True, args.steps, targets=ATTENTION), time_torch(path, ids, True, args.steps,
                                                                                  targets=ATTENTION))
    lora = {"jaxformer": median(jax_times), "transformers": median(torch_times)}
    result = {"settings": vars(args), "hardware": hardware(), "prefill_s": prefill, "lora_step_s": lora,
              "prefill_ratio": prefill["transformers"] / prefill["jaxformer"],
              "lora_step_ratio": lora["transformers"] / lora["jaxformer"],
              "first_losses": [jax_first, torch_first]}
    print(f"{result['hardware']}\nprefill of {args.seq_len}: jaxformer {prefill['jaxformer']:.3f} s, transformers "
          f"{prefill['transformers']:.3f} s: {result['prefill_ratio']:.2f}x\nLoRA step 1 x {args.seq_len}: jaxformer "
          f"{lora['jaxformer']:.3f} s, transformers + peft {lora['transformers']:.3f} s: "
          f"{result['lora_step_ratio']:.2f}x (first losses {jax_first:.5f}, {torch_first:.5f})")
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="moe_steps.json")
    args = p.parse_args(argv)
    result = run(args)
    if not np.isclose(*result["first_losses"], rtol=1e-4):
        raise SystemExit(f"the first losses differ: {result['first_losses']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
