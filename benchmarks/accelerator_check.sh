#!/usr/bin/env bash
# The first run on a GPU or TPU, in one command from the checkout (nothing installed, no network):
#
#     PYTHONPATH=. bash benchmarks/accelerator_check.sh [OUT_DIR]
#
# It needs what an accelerator image typically has (jax with its plugin, flax, optax, orbax,
# chex, pytest, pytest-xdist) and runs, each under its own time limit, in about 5 minutes:
#   selfcheck       the numerical self-check on the default device
#   tests           the suite's numerical core: products, attention, the decoder, LoRA, decoding
#   train_reverse   the main job, `python -m train.reverse`, with its defaults
#   decode_1b       greedy decoding of the 1B shape (random weights written on the spot),
#                   float32 and bfloat16, batch 1 and 8: tokens/s and % of the read floor
# Each step's output is in OUT_DIR/<step>.log, one line per step in OUT_DIR/summary.txt, the
# decoding figures in OUT_DIR/decode_1b.json. The status is non-zero when any step failed.
set -u
out=${1:-accelerator_check}
mkdir -p "$out"
: > "$out/summary.txt"
status=0

step() {  # step NAME SECONDS COMMAND...: runs it, logs it, records how it went
  local name=$1 limit=$2 start=$SECONDS result
  shift 2
  echo "== $name"
  if timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1; then result=ok; else result="failed (status $?)"; status=1; fi
  echo "$name: $result in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 6 "$out/$name.log"
}

python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/summary.txt"
step selfcheck 120 python -m jaxformer.selfcheck
step tests 240 python -m pytest -q -p no:cacheprovider -n 8 tests/test_products.py tests/test_attention.py \
  tests/test_decoder.py tests/test_feedforward.py tests/test_norms.py tests/test_positions.py tests/test_losses.py \
  tests/test_lora.py tests/decoding
step train_reverse 300 python -m train.reverse --run-dir "$out/reverse"
step checkpoint_1b 120 python -m benchmarks.llama_1b "$out/llama_1b"
step decode_1b 300 python -m benchmarks.decode_1b "$out/llama_1b" --no-peer --batch 1 8 --prompt 32 --new 64 \
  --out "$out/decode_1b.json"
rm -rf "$out/llama_1b" "$out/reverse/checkpoints"
exit $status
