#!/usr/bin/env bash
# The first run on a GPU or TPU, in one command from the checkout (nothing installed, no network):
#
#     PYTHONPATH=. bash benchmarks/accelerator_check.sh [OUT_DIR]
#
# It needs what an accelerator image typically has (jax with its plugin, flax, optax, orbax,
# chex, pytest, pytest-xdist) and runs, each under its own time limit (449 s in all on a 2-core CPU;
# on an H200 the tests step alone took over 290 s, most of it compiling):
#   selfcheck       the numerical self-check on the default device
#   tests           the suite's numerical core: products, attention, the decoder, LoRA, decoding
#   train_reverse   the main job, `python -m train.reverse`, with its defaults
#   decode_1b       greedy decoding of the 1B shape (random weights written on the spot),
#                   float32 and bfloat16, batch 1 and 8: tokens/s and % of the read floor
#   long_context    a training step at T = 2k and 8k, attention in blocks (on a GPU or TPU the
#                   Pallas kernels) against the dense jnp attention: XLA's temporary bytes and,
#                   on a device (up to 2k on a CPU), the step times in the same run
#   attention_paths attention alone, forward and gradient, dense, the jnp blocks and the platform's
#                   kernel, at T = 2k and 8k (2k on a CPU): times in the same run
# Each step's output is in OUT_DIR/<step>.log, one line per step in OUT_DIR/summary.txt, the
# figures in OUT_DIR/decode_1b.json, long_context.json and attention_paths.json, and all in one
# OUT_DIR/accelerator_check.json with the summary. The status is non-zero when any step failed.
# ACCELERATOR_CHECK_STEPS="tests long_context" runs those steps alone (a device's time is short;
# decode_1b needs checkpoint_1b's checkpoint).
set -u
out=${1:-accelerator_check}
only=${ACCELERATOR_CHECK_STEPS:-}
mkdir -p "$out"
: > "$out/summary.txt"
status=0

step() {  # step NAME SECONDS COMMAND...: runs it, logs it, records how it went
  local name=$1 limit=$2 start=$SECONDS result
  shift 2
  if [ -n "$only" ] && [[ " $only " != *" ${name%_collect} "* ]]; then return; fi  # (tests_collect: with tests)
  echo "== $name"
  if timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1; then result=ok; else result="failed (status $?)"; status=1; fi
  echo "$name: $result in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 6 "$out/$name.log"
}

python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/summary.txt"
backend=$(python -c "import jax; print(jax.default_backend())")
step selfcheck 120 python -m jaxformer.commands.selfcheck
# The tests: 8 pytest-xdist workers share the one device (most of their time is compiling, on
# the host's cores; on a CPU, one worker a core). JAX gives each process 75% of the device's memory up front by default;
# off, each takes what it uses (with it on, a later worker backs off through dozens of failed
# allocations and gets what is left). pytest-benchmark, where the image has it, only warns
# under xdist: blocked (`-p no:` of a plugin that is absent is fine).
# -v: each test's name and outcome as it ends, so a run cut short by its limit still says which failed.
step tests 420 env XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -v -rf --tb=short -p no:cacheprovider \
  -p no:benchmark -n "$([ "$backend" = cpu ] && nproc || echo 8)" \
  tests/test_products.py tests/test_attention.py tests/test_decoder.py tests/test_feedforward.py tests/test_norms.py \
  tests/test_positions.py tests/test_losses.py tests/test_lora.py tests/test_blockwise.py tests/kernels tests/decoding
# A worker that dies before its first test (XLA aborting as JAX starts, e.g. on a flag in
# XLA_FLAGS it does not know) leaves only "node down: Not properly terminated" in tests.log:
# pytest's capture held its stderr. One file collected in this process, uncaptured, says why.
if grep -qs "node down" "$out/tests.log"; then
  step tests_collect 60 env XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -q -p no:cacheprovider \
    -p no:benchmark -n 0 -s --collect-only tests/decoding/test_generation.py
fi
step train_reverse 300 python -m train.reverse --run-dir "$out/reverse"
step checkpoint_1b 120 python -m benchmarks.llama_1b "$out/llama_1b"
step decode_1b 300 python -m benchmarks.decode_1b "$out/llama_1b" --no-peer --batch 1 8 --prompt 32 --new 64 \
  --out "$out/decode_1b.json"
timed=$([ "$backend" = cpu ] && echo 2048 || echo 8192)  # (an 8k step of dense attention takes minutes on a CPU)
step long_context 180 python -m benchmarks.long_context --lengths 2048 8192 --time-up-to "$timed" \
  --out "$out/long_context.json"
step attention_paths 120 python -m benchmarks.attention_paths --lengths $([ "$backend" = cpu ] && echo 2048 || echo 2048 8192) \
  --out "$out/attention_paths.json"
rm -rf "$out/llama_1b" "$out/reverse/checkpoints"
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
figures = {"summary": (out / "summary.txt").read_text().splitlines()}
for name in ("decode_1b", "long_context", "attention_paths"):
    path = out / f"{name}.json"
    figures[name] = json.loads(path.read_text()) if path.exists() else None  # (None: the step failed)
(out / "accelerator_check.json").write_text(json.dumps(figures, indent=1))
print(f"figures: {out / 'accelerator_check.json'}")
PY
exit $status
