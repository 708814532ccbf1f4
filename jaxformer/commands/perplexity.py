"""`jaxformer-perplexity --checkpoint DIR --data FILE`: a checkpoint's perplexity on a text,
by the sliding-window procedure transformers documents for fixed-length models.

  jaxformer-perplexity --checkpoint DIR --data held_out.txt --window 1024 --stride 512
  jaxformer-perplexity --checkpoint DIR --adapter RUN_DIR/adapter --data held_out.txt

The text is tokenized whole, as the checkpoint's tokenizer frames a text (Llama's: BOS
first), and scored by `jaxformer.text.perplexity.perplexity`, whose docstring gives the
windows and how they are combined; docs/text.md, "Perplexity", says more.
"""

from __future__ import annotations

import dataclasses
import json

from jaxformer.command_line import (
    FAILED,
    OneLineParser,
    add_quantize_flags,
    check_quantization,
    exit_process,
    fail,
    loading_memory,
    quantization,
    run_command,
)
from jaxformer.config import DTYPES
from jaxformer.convert import load_hf, load_hf_config
from jaxformer.convert.peft import load_peft
from jaxformer.decoder import Decoder
from jaxformer.files import read_text
from jaxformer.lora import merge
from jaxformer.quantized import quantize_params
from jaxformer.sharding import param_axes
from jaxformer.text.perplexity import perplexity
from jaxformer.text.tokenizer import check_fits_model, load_tokenizer
from jaxformer.validation import NotFinite, as_int

PROG = "jaxformer-perplexity"
DEFAULT_WINDOW = 1024  # or the model's context, where that is shorter


def parse_args(argv=None):
    """The flags; what can be checked without the checkpoint is checked here (one line, status 2)."""
    p = OneLineParser(PROG, __doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a Hugging Face checkpoint folder")
    p.add_argument("--data", required=True, metavar="FILE", help="the UTF-8 text to score")
    p.add_argument("--adapter", metavar="DIR", help="a peft LoRA adapter folder, merged into the weights first")
    p.add_argument("--window", type=int, default=None,
                   help=f"ids a window reads (default: {DEFAULT_WINDOW}, or the model's context if shorter)")
    p.add_argument("--stride", type=int, default=None, help="ids between window starts (default: half the window)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="compute and weight dtype")
    add_quantize_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        if args.window is not None:  # (the model's context bounds it too, once config.json is read)
            as_int(args.window, "--window", minimum=2)
        if args.stride is not None:
            as_int(args.stride, "--stride", minimum=1, maximum=args.window, maximum_name="--window")
        args.quantization = quantization(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    args = parse_args(argv)
    try:  # every flag and file checked, cheapest first, before the weights are read
        text = read_text(args.data, "--data")
        config = load_hf_config(args.checkpoint, dtype=DTYPES[args.dtype])
        window = min(DEFAULT_WINDOW, config.max_seq_len) if args.window is None else args.window
        stride = max(1, window // 2) if args.stride is None else args.stride
        as_int(window, "--window", minimum=2, maximum=config.max_seq_len, maximum_name="the model's context")
        as_int(stride, "--stride", minimum=1, maximum=window, maximum_name="--window")
        tokenizer = load_tokenizer(args.checkpoint)
        check_fits_model(tokenizer, config.vocab_size, args.checkpoint)
        ids = tokenizer.encode(text)  # framed as the tokenizer frames a text (BOS first, for Llama's)
        if len(ids) < 2:
            raise ValueError(f"--data {args.data} holds {len(ids)} token(s): at least 2 are needed")
        check_quantization(config, args.quantization)
        adapter = None if args.adapter is None else load_peft(config, args.adapter)
        # (An adapter is merged into the float matrices, which --quantize then rounds once: as jaxformer-generate.)
        with loading_memory():
            _, params = load_hf(args.checkpoint, dtype=DTYPES[args.dtype],
                                quantize=args.quantization if adapter is None else None)
    except (OSError, ValueError) as e:
        fail(PROG, str(e))
    if adapter is not None:
        params = merge(params, *adapter)
        if args.quantization is not None:
            params = quantize_params(params, param_axes(Decoder(config)), args.quantization)
    try:
        result = perplexity(Decoder(config), params, ids, window, stride)
    except NotFinite as e:
        fail(PROG, str(e), FAILED)
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "window": window, "stride": stride}))
    else:
        print(f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.4f}) over {result.tokens:,} tokens, "
              f"{result.windows} window(s) of up to {window}, stride {stride}")
    return 0


if __name__ == "__main__":
    exit_process(main())
