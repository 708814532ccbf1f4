"""A checkpoint shaped like gpt-oss-20b as openai ships it, its experts in MXFP4, with random weights
made on the spot (nothing is downloaded), decoded by jaxformer as shipped and by transformers, each in
a fresh process.

    python -m benchmarks.gpt_oss_20b DIR [--layers 24] [--seed 0] [--reuse] [--batch 1] [--prompt 16]
        [--new 8] [--reps 1] [--no-peer] [--peer-limit GIB] [--out gpt_oss_20b.json]

`DIR` gets the folder openai ships: gpt-oss-20b's `config.json` (below: 24 layers, d_model 2880, 64
query and 8 key/value heads of 64 with biases and sinks, sliding over 128 positions and full by turns,
YaRN; every feed-forward 32 experts of 2880 with 4 a token; vocabulary 201,088, an untied head), its
`quantization_config` (MXFP4), shards of about 5 GB with their index, and `llama_1b`'s byte-level BPE
tokenizer. Each expert tensor ships as MXFP4: `X_blocks` uint8 `[E, out, in / 32, 16]` (two e2m1
values a byte) and `X_scales` uint8 `[E, out, in / 32]` (e8m0, `2 ** (s - 127)` for each 32 inputs);
every other tensor (attention, its sinks, the router, the experts' biases, the embedding, the head,
the norms) in bfloat16. 20.9 B parameters, 13.76 GB of files. They are written tensor by tensor, one
in memory at a time (the embedding's 1.16 GB the largest).

Random weights at a real model's scale: bfloat16 matrices, biases and sinks normal with std 0.02,
norm weights 1. The experts' bytes are uniform, so each e2m1 value is one of the 16 with equal
chance: mean 0, mean square 68.5 / 8, std 2.93; each block's exponent is 2 ** -8 or 2 ** -7 at
random (e8m0 119 or 120), so the weights' std is 2.93 * sqrt((2 ** -16 + 2 ** -14) / 2) = 0.018,
about the 0.02 of the rest. `--layers` makes a shallower model of the same width.

Then, each in a process of its own (its peak memory its own):

- jaxformer: `load_hf(DIR, dtype=bfloat16)` (as its commands load, `loading_memory`), its experts
  kept in MXFP4 as read and everything else bfloat16 as stored (float32 would double those 3.6 GB);
  greedy `generate` of `--new` tokens after a `--prompt`-token prompt at each batch size (the whole
  loop one jitted program, its first call timed apart): new tokens/s, its weights' bytes, its peak
  resident memory (Linux's VmHWM) against the folder's file size (the goal: within 1.3x). Batch 1 by
  default: a step of 8 rows reads up to all 32 experts of each layer, not 4.
- transformers: `from_pretrained(DIR, dtype=bfloat16)`, which on a CPU expands MXFP4 to bfloat16
  (the real size's model 41.8 GB): its tokens/s, their ratio to jaxformer's, and whether the greedy
  tokens agree; or its failure, recorded beside its bfloat16 model's bytes.

Each process is watched (every POLL seconds) and killed once its own memory (resident and anonymous:
what the machine, without swap, cannot take back; the files it maps are not) passes a limit, so that
a side too large for the machine fails rather than exhausts it: by default the memory available once
the folder is written, less 2 GiB; `--peer-limit` sets transformers'. A side killed so is recorded with the memory
it had reached and its last line as printed (how far it got); a side failing on its own, with its
exit status and last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from benchmarks.llama_1b import tokenizer, write_folder_files, write_shards

# gpt-oss-20b's config.json as published (the architecture fields; token ids are the tokenizer's).
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
GOAL = 1.3  # jaxformer's peak resident memory against the folder's file size
BF16, U8 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint8)
POLL = 0.05  # seconds between looks at a side's memory
ROWS = 1 << 13  # rows of a bfloat16 tensor drawn at once (the embedding's: 94 MB of float32)


def config(layers: int | None = None, **sizes) -> dict:
    """CONFIG with `layers` layers (sliding and full by turns, as shipped) and `sizes` replacing its
    fields (a smaller model for a test)."""
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    n = layers or CONFIG["num_hidden_layers"]
    return dict(CONFIG, num_hidden_layers=n, layer_types=["sliding_attention", "full_attention"] * (n // 2)
                + ["sliding_attention"] * (n % 2), **sizes)


def tensors(config: dict) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each tensor's name, shape (torch's `[out, in]` for a Linear) and dtype as gpt-oss ships: the
    experts' `gate_up_proj` (`[E, 2F, d]`, gate and up rows by turns) and `down_proj` (`[E, d, F]`) in
    MXFP4 blocks and scales, the rest bfloat16."""
    d, F, E = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    heads, kv, head = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    if d % 32 or F % 32:
        raise ValueError(f"config: hidden_size {d} and intermediate_size {F} must be multiples of 32 (MXFP4's block)")
    out = {"model.embed_tokens.weight": ((config["vocab_size"], d), BF16), "model.norm.weight": ((d,), BF16),
           "lm_head.weight": ((config["vocab_size"], d), BF16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": ((d,), BF16), p + "post_attention_layernorm.weight": ((d,), BF16),
                p + "self_attn.sinks": ((heads,), BF16), p + "mlp.router.weight": ((E, d), BF16),
                p + "mlp.router.bias": ((E,), BF16)}
        for name, n_out, n_in in (("q", heads * head, d), ("k", kv * head, d), ("v", kv * head, d),
                                  ("o", d, heads * head)):
            out |= {p + f"self_attn.{name}_proj.weight": ((n_out, n_in), BF16),
                    p + f"self_attn.{name}_proj.bias": ((n_out,), BF16)}
        for name, n_out, n_in in (("gate_up_proj", 2 * F, d), ("down_proj", d, F)):
            x = p + "mlp.experts." + name
            out |= {x + "_blocks": ((E, n_out, n_in // 32, 16), U8), x + "_scales": ((E, n_out, n_in // 32), U8),
                    x + "_bias": ((E, n_out), BF16)}
    return out


def file_bytes(config: dict) -> int:
    """The bytes of the tensors `tensors(config)` (the index's total_size)."""
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in tensors(config).values())


def parameters(config: dict) -> int:
    """The model's parameters: an MXFP4 byte two of them, its scales none."""
    return sum(int(np.prod(shape)) * (2 if name.endswith("_blocks") else 1)
               for name, (shape, _) in tensors(config).items() if not name.endswith("_scales"))


def draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Tensor `name`'s random values (the module's docstring gives their scale)."""
    if name.endswith("_blocks"):  # uniform bytes: two uniform e2m1 codes each
        return np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape)
    if name.endswith("_scales"):  # e8m0 119 or 120: 2 ** -8 or 2 ** -7
        return rng.integers(119, 121, shape, dtype=np.uint8)
    if name.endswith("norm.weight"):
        return np.ones(shape, BF16)
    w = np.empty(shape, BF16)
    for start in range(0, shape[0], ROWS):  # a slice at a time: no float32 copy of the whole tensor
        rows = w[start:start + ROWS]
        rows[...] = rng.standard_normal(rows.shape, np.float32) * 0.02
    return w


def write(folder: str, config: dict = CONFIG, *, seed: int = 0) -> str:
    """Writes the random checkpoint of `config` into `folder` (created); returns `folder`."""
    tok = tokenizer()
    eos = tok.token_to_id("<|end_of_text|>")
    config = dict(config, bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=eos, pad_token_id=eos)
    os.makedirs(folder, exist_ok=True)
    rng, shapes = np.random.default_rng(seed), tensors(config)
    weight_map = write_shards(folder, shapes, lambda name: draw(name, shapes[name][0], rng))
    return write_folder_files(folder, config, file_bytes(config), weight_map, tok)


def weights_file_bytes(folder: str) -> int:
    """The bytes of `folder`'s safetensors files, as they lie on disk."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def jaxformer_side(folder: str, batches: list[int], prompt_len: int, new: int, reps: int) -> dict:
    from benchmarks.quantized_decode import jaxformer_row

    return jaxformer_row(folder, "bfloat16", batches, prompt_len, new, reps)


def transformers_side(folder: str, batches: list[int], prompt_len: int, new: int, reps: int) -> dict:
    from benchmarks.moe_decode import transformers_side as side

    got = side(folder, batches, prompt_len, new, reps, dtype="bfloat16")
    return {"rows": got["rows"], "peak_rss": got["peak_rss"], "weight_bytes": got["weights_bytes"]}


SIDES = {"jaxformer": jaxformer_side, "transformers": transformers_side}


def available_memory() -> int:
    """The memory Linux can give without swapping (MemAvailable), in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def own_memory(pid: int) -> int:
    """Process `pid`'s resident anonymous memory in bytes (RssAnon; 0 once it has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
    except FileNotFoundError:
        return 0


def watched(child: subprocess.Popen, limit: int) -> int | None:
    """Waits for `child`, killing it once its own memory passes `limit` bytes: the memory it had
    reached then, or None if it ended by itself."""
    while child.poll() is None:
        if (reached := own_memory(child.pid)) > limit:
            child.kill()
            child.wait()
            return reached
        time.sleep(POLL)
    return None


def in_a_process(args, side: str, limit: int) -> dict:
    """`side`'s measurements from a fresh Python process, `watched` with `limit`: its JSON result, or
    how it failed (killed at its memory then, or its exit status) and its last line as printed."""
    command = [sys.executable, "-m", "benchmarks.gpt_oss_20b", args.folder, "--side", side, "--batch",
               *map(str, args.batch), "--prompt", str(args.prompt), "--new", str(args.new), "--reps", str(args.reps)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # (pipes could fill and block)
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        killed_at = watched(child, limit)
        out.seek(0)
        err.seek(0)
        printed, errors = out.read(), err.read().strip().splitlines()[-1:]  # (a progress bar's last state)
    if killed_at is not None:
        return {"failed": errors, "killed_at": killed_at, "limit": limit}
    if child.returncode:
        return {"failed": errors, "returncode": child.returncode, "limit": limit}
    return json.loads(printed.strip().splitlines()[-1])


def report(results: dict, file_size: int, params: int) -> list[str]:
    """One line per (side, batch): tokens/s, weights and peak RSS against the file size, and for
    transformers its ratio to jaxformer's and whether the tokens agree; or how the side failed."""
    ours = {row["batch"]: row for row in results["jaxformer"]["rows"]}
    lines = []
    for side, got in results.items():
        if "failed" in got:
            how = (f"killed at {got['killed_at'] / 2**30:.2f} GiB of its own memory, over" if "killed_at" in got
                   else f"failed (exit {got['returncode']}) under")
            how += f" its limit of {got['limit'] / 2**30:.2f} GiB"
            if side == "transformers":  # (MXFP4 expanded)
                how += f" (its bfloat16 model {2 * params / 2**30:,.2f} GiB)"
            lines.append(f"{side:12s} {how}; its last line: {' '.join(got['failed']) or '(none)'}")
            continue
        for row in got["rows"]:
            line = (f"{side:12s} batch {row['batch']}: {row['tokens_per_s']:7.2f} tokens/s, weights "
                    f"{got['weight_bytes'] / 2**20:,.0f} MiB, peak RSS {got['peak_rss'] / 2**20:,.0f} MiB, "
                    f"RSS / file size {got['peak_rss'] / file_size:.2f}")
            if side == "jaxformer":
                line += f" (goal {GOAL}x: {'met' if got['peak_rss'] <= GOAL * file_size else 'not met'})"
            else:
                line += (f"; {row['tokens_per_s'] / ours[row['batch']]['tokens_per_s']:.2f}x jaxformer's, "
                         f"same tokens: {row['tokens'] == ours[row['batch']]['tokens']}")
            lines.append(line)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt_oss_20b", description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shipped 24")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="DIR holds the checkpoint already: read, not written again")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--no-peer", action="store_true", help="jaxformer alone (no transformers rows)")
    p.add_argument("--peer-limit", type=float, default=None,
                   help="transformers' memory limit in GiB (default: the memory available less 2 GiB)")
    p.add_argument("--out", default="gpt_oss_20b.json")
    p.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(SIDES[args.side](args.folder, args.batch, args.prompt, args.new, args.reps)))
        return
    if args.peer_limit is not None and args.peer_limit <= 0:
        p.error(f"--peer-limit must be > 0 GiB, got {args.peer_limit}")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if not args.reuse:
        start = time.perf_counter()
        write(args.folder, config(args.layers), seed=args.seed)
        print(f"wrote {args.folder} in {time.perf_counter() - start:.0f} s", flush=True)
    limit = available_memory() - 2 * 2**30
    with open(os.path.join(args.folder, "config.json")) as f:
        written = json.load(f)
    file_size, params = weights_file_bytes(args.folder), parameters(written)
    print(f"{written['num_hidden_layers']} layers, {params / 1e9:.2f} B parameters, files {file_size / 2**20:,.0f} MiB",
          flush=True)
    results = {"jaxformer": in_a_process(args, "jaxformer", limit)}
    if "failed" in results["jaxformer"]:
        raise RuntimeError(f"jaxformer: {report(results, file_size, params)[0]}")
    if not args.no_peer:
        peer_limit = limit if args.peer_limit is None else int(args.peer_limit * 2**30)
        results["transformers"] = in_a_process(args, "transformers", peer_limit)
    for line in report(results, file_size, params):
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k != "side"}, "file_bytes": file_size,
                   "parameters": params, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
