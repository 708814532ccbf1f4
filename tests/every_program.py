"""Runs every jitted program a user's path compiles, once, on tiny models: `python
tests/every_program.py DIR` (DIR a scratch folder). `tests/test_constants.py` runs it with
`JAX_DUMP_IR_TO` set, so that each program's StableHLO is written out as it is lowered, and
reads them for constants.

The paths: the training steps and their validation (`train.reverse`, `train.lm`,
`jaxformer-finetune` with LoRA and with --full), generation (greedy, sampled, beams, prompt
lookup, a draft model, streamed, an adapter), perplexity, and the serving engine's
prefill and step."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "faults")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import random_params, run_main  # noqa: E402
from tiny_llama import TOKENIZER  # noqa: E402

from jaxformer import Decoder, DecoderConfig  # noqa: E402
from jaxformer.commands import finetune, perplexity  # noqa: E402
from jaxformer.commands import generate as generate_command  # noqa: E402
from jaxformer.convert import load_hf, save_hf  # noqa: E402
from jaxformer.decoding import DecodeOptions, Draft, generate, stream  # noqa: E402
from jaxformer.serving.engine import Engine  # noqa: E402
from jaxformer.text import save_tokenizer  # noqa: E402
from train import lm, reverse  # noqa: E402

TEXT = "Keys and values are cached, so each new token costs one step. " * 20
# Each matrix of these models holds 128 x 512 float32s (256 KiB), over the test's limit, so a
# parameter closed over anywhere shows.
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, n_layer=1, n_head=4, n_kv_head=2, d_model=128, d_ff=512,
                       max_seq_len=64)


def ran(done, what: str) -> None:
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def main(root: Path) -> None:
    checkpoint, data = str(root / "checkpoint"), str(root / "text.txt")
    save_hf(CONFIG, random_params(CONFIG, seed=0, scale=0.2), checkpoint, bos_id=TOKENIZER.bos_id,
            eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    save_tokenizer(TOKENIZER, checkpoint)
    (root / "text.txt").write_text(TEXT)
    tiny = ["--n-layer", "1", "--d-model", "128", "--n-head", "2", "--batch-size", "4", "--eval-size", "8",
            "--log-every", "2", "--checkpoint-every", "2", "--steps", "2", "--warmup", "1"]
    ran(run_main(reverse.main, [*tiny, "--d-ff", "512", "--run-dir", str(root / "reverse")]), "train.reverse")
    ran(run_main(lm.main, [*tiny, "--n-kv-head", "1", "--run-dir", str(root / "lm")]), "train.lm")
    tune = ["--checkpoint", checkpoint, "--data", data, "--steps", "2", "--log-every", "2", "--checkpoint-every", "2",
            "--warmup", "1", "--batch-size", "2", "--seq-len", "32"]
    ran(run_main(finetune.main, [*tune, "--lora-rank", "4", "--run-dir", str(root / "lora")]), "jaxformer-finetune")
    ran(run_main(finetune.main, [*tune, "--full", "--run-dir", str(root / "full")]), "jaxformer-finetune --full")
    decode = ["--checkpoint", checkpoint, "--prompt", "Keys and", "--max-new-tokens", "6", "--max-seq-len", "64"]
    for extra in ([], ["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9"], ["--num-beams", "2"],
                  ["--prompt-lookup", "2"], ["--stream"], ["--adapter", str(root / "lora" / "adapter")]):
        ran(run_main(generate_command.main, [*decode, *extra]), f"generate {' '.join(extra)}")
    ran(run_main(perplexity.main, ["--checkpoint", checkpoint, "--data", data, "--window", "32"]), "perplexity")

    config, params = load_hf(checkpoint, max_seq_len=64)
    model = Decoder(config)
    draft_model = Decoder(DecoderConfig(vocab_size=config.vocab_size, n_layer=1, n_head=2, d_model=16,
                                        max_seq_len=64))
    draft = Draft(draft_model, draft_model.init(jax.random.key(1), *draft_model.init_inputs())["params"], k=2)
    prompt = jnp.ones((2, 4), jnp.int32)
    generate(model, params, prompt, speculative=draft, max_new_tokens=5)
    list(stream(model, params, prompt, speculative=draft, max_new_tokens=5))
    engine = Engine(model, params, max_batch=2, capacity=64)
    try:
        engine.submit([1, 2, 3], DecodeOptions(max_new_tokens=4, temperature=0.7, key=jax.random.key(1))).result()
    finally:
        engine.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
