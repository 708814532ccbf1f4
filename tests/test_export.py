"""Every program a user's path compiles lowers for CUDA and TPU.

This machine has neither, but `jax.export.export(program, platforms=("cuda", "tpu"))` lowers
a jitted program with each platform's lowering rules all the same: an operation, a sharding or
a kernel that one of them cannot lower fails here, not on the accelerator. `export_programs.py`
runs `every_program.py`'s paths in a process of its own with each program exported at each
new signature it is called with; the tests below read what it recorded.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import with_sinks
from export_programs import RECORDS, ExportingJit, exporting_jit, program_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxformer import Decoder, DecoderConfig, KVCache, chunked_cross_entropy
from jaxformer.experts import ExpertsSpec
from jaxformer.kernels import CUDA_CUSTOM_CALL_TARGETS
from jaxformer.layers import layer_specs

HERE = Path(__file__).parent
PLATFORMS = ["cuda", "tpu"]

# Every program the paths call, as `export_programs.program_name` names it: a program renamed,
# added or no longer called fails `test_the_programs_exported_are_those_listed` until listed here.
PROGRAMS = {
    "jaxformer.decoder:Decoder.init",
    "partial(jaxformer.decoder:Decoder.apply)",  # train.lm's forward, for the attention maps
    "jaxformer.vanilla:VanillaTransformer.init",
    "partial(jaxformer.vanilla:VanillaTransformer.apply)",
    "jaxformer.decoding.front_door:run",
    "jaxformer.decoding.front_door:start",
    "jaxformer.decoding.front_door:advance",
    "jaxformer.decoding.front_door:finish",
    "jaxformer.lora:_merged",
    "jaxformer.schedules:noam_schedule.<locals>.schedule",
    "jaxformer.schedules:warmup_cosine_schedule.<locals>.schedule",
    "jaxformer.serving.engine:Engine._compile.<locals>.piece",
    "jaxformer.serving.engine:Engine._compile.<locals>.pick",
    "jaxformer.serving.engine:Engine._compile.<locals>.step",
    "jaxformer.serving.engine:Engine._compile.<locals>.fused",
    "jaxformer.serving.engine:Engine._compile.<locals>.<lambda>",  # the row insert and the empty row
    "jaxformer.text.dataset:windows",
    "jaxformer.text.perplexity:_window_nll",
    "jaxformer.training.averaging:_mean",
    "jaxformer.commands.finetune:_held_out_sums",
    "jaxformer.commands.finetune:snapshotter.<locals>.attention_weights",
    "jaxformer.training.loop:_all_finite",
    "jaxformer.training.loop:_note_nonfinite",
    "jaxformer.training.state:TrainState.create.<locals>.<lambda>",
    "jaxformer.training.state:_step_keys",
    "jaxformer.training.state:_update.<locals>.train_step",
    "jaxformer.training.state:make_train_steps.<locals>.train_steps",
    "train.tasks:copy_batch",
    "train.tasks:copy_prompts",
    "train.tasks:reverse_batch",
}

TRAIN_STEP = "jaxformer.training.state:_update.<locals>.train_step"
RUN, START, ADVANCE, FINISH = (f"jaxformer.decoding.front_door:{name}" for name in ("run", "start", "advance",
                                                                                    "finish"))
ENGINE = "jaxformer.serving.engine:Engine._compile.<locals>."
GREEDY = "generate "  # (as every_program.py names the command without options: a space after it)
SAMPLED = "generate --temperature 0.8 --top-k 5 --top-p 0.9"
DRAFT_AND_ENGINE, WARMUP = "draft model and serving engine", "serving engine's warmup"
PROMPT_LOOKUP, DRAFT = "Speculative(proposer=PromptLookup)", "Speculative(proposer=_DraftSpec)"
# The entry points: (what, the path that calls it, the program, arguments it must have been exported with).
ENTRY_POINTS = [
    ("train.reverse's training steps (scanned)", "train.reverse",
     "jaxformer.training.state:make_train_steps.<locals>.train_steps", {}),
    ("train.lm's training step", "train.lm", TRAIN_STEP, {"frozen": "None"}),
    ("fine-tuning's LoRA step (the base frozen beside it)", "jaxformer-finetune", TRAIN_STEP, {"frozen": "dict"}),
    ("fine-tuning's full step", "jaxformer-finetune --full", TRAIN_STEP, {"frozen": "None"}),
    ("greedy generate's prefill", GREEDY, START, {"strategy": "Plain"}),
    ("greedy generate's loop", GREEDY, FINISH, {"strategy": "Plain"}),
    ("sampled generate's loop", SAMPLED, FINISH, {"strategy": "Plain"}),
    ("beam search", "generate --num-beams 2", RUN,
     {"strategy": "Beam", "request": "DecodeRequest(max_new_tokens=6, num_beams=2)"}),
    ("stream's prefill", "generate --stream", START, {"strategy": "Plain"}),
    ("stream's round", "generate --stream", ADVANCE, {"strategy": "Plain"}),
    ("prompt lookup's speculative rounds", "generate --prompt-lookup 2", FINISH, {"strategy": PROMPT_LOOKUP}),
    ("a draft model's speculative run", DRAFT_AND_ENGINE, RUN, {"strategy": DRAFT}),
    ("a draft model's streamed speculative round", DRAFT_AND_ENGINE, ADVANCE, {"strategy": DRAFT}),
    ("perplexity", "perplexity", "jaxformer.text.perplexity:_window_nll", {}),
    ("the serving engine's prefill", DRAFT_AND_ENGINE, ENGINE + "piece", {}),
    ("the serving engine's step", DRAFT_AND_ENGINE, ENGINE + "step", {}),
    ("the serving engine's fused prefill and step", WARMUP, ENGINE + "fused", {}),
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> list[dict]:
    """`export_programs.py`'s records (one per program and signature), its run in a process of its own."""
    root = tmp_path_factory.mktemp("export")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "export_programs.py"), str(root)], cwd=HERE.parent, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = json.loads((root / "exports.json").read_text())
    signatures = Counter(record["program"] for record in records)
    print(f"\n{len(signatures)} programs exported ({len(records)} signatures, "
          f"{sum(r['seconds'] for r in records):.1f} s of exports):")
    for name, count in sorted(signatures.items()):
        print(f"  {name}  x{count}")
    return records


def test_every_program_exports_for_cuda_and_tpu(exports):
    failed = [f"{r['program']} (in {', '.join(r['paths'])}; {r['args']}):\n{r['error']}" for r in exports if r["error"]]
    assert failed == [], "\n\n".join(failed)
    per_platform = {platform: sum(platform in r["platforms"] for r in exports) for platform in PLATFORMS}
    print(f"\nexported, per platform: {per_platform}")
    assert per_platform == {platform: len(exports) for platform in PLATFORMS}


def test_the_programs_exported_are_those_listed(exports):
    names = {r["program"] for r in exports}
    assert names == PROGRAMS, f"called but not listed: {sorted(names - PROGRAMS)}; listed, not called: " \
                              f"{sorted(PROGRAMS - names)}"


@pytest.mark.parametrize("what, path, program, arguments", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
def test_each_entry_point_is_exported(exports, what, path, program, arguments):
    called = [r for r in exports if r["program"] == program and path in r["paths"]]
    assert any(arguments.items() <= r["args"].items() for r in called), \
        (what, [(r["paths"], r["args"]) for r in exports if r["program"] == program])
    assert all(r["error"] is None for r in called)


# The recording itself, in this process: `ExportingJit` used directly, `jax.jit` left as it is.

def test_a_program_is_exported_once_per_signature_and_runs_as_jitted():
    def scaled(x, times):
        return x * times

    program = ExportingJit(scaled, {"static_argnums": 1, "donate_argnums": 0})
    start = len(RECORDS)
    np.testing.assert_array_equal(program(jnp.arange(4.0), 2), [0.0, 2.0, 4.0, 6.0])
    program(jnp.ones(4), 2)  # the same signature: not again
    program(jnp.ones(8), 2)  # a new shape
    program(jnp.ones(4), 3)  # a new static argument
    program(jnp.ones(4, jnp.int32), 3)  # a new dtype
    jax.jit(lambda x: program(x, 2))(jnp.ones(4))  # inside another program: part of it, not one of its own
    compiled = program.lower(jax.ShapeDtypeStruct((2,), jnp.float32), 2).compile()  # compiled ahead: a new shape
    np.testing.assert_array_equal(compiled(jnp.ones(2)), [2.0, 2.0])
    program.lower(jnp.ones(8), 2)  # lowered at a signature already called: not again
    new = RECORDS[start:]
    assert [r["args"] for r in new] == [{"x": "float32[4]", "times": "2"}, {"x": "float32[8]", "times": "2"},
                                        {"x": "float32[4]", "times": "3"}, {"x": "int32[4]", "times": "3"},
                                        {"x": "float32[2]", "times": "2"}]
    assert all(r["platforms"] == PLATFORMS and r["error"] is None for r in new)
    assert program_name(scaled) == "test_export:test_a_program_is_exported_once_per_signature_and_runs_as_jitted" \
                                   ".<locals>.scaled"


def test_a_program_that_cannot_be_exported_is_recorded_with_why():
    """A host callback lowers only for the platform of a device this process has (the CPU): the
    record says why for each platform, and the program still runs on the CPU, so that the
    paths go on to the next program."""
    def doubled_on_the_host(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    program = ExportingJit(doubled_on_the_host, {})
    start = len(RECORDS)
    np.testing.assert_array_equal(program(jnp.arange(3.0)), [0.0, 2.0, 4.0])
    (record,) = RECORDS[start:]
    assert record["platforms"] == [] and "cuda: " in record["error"] and "tpu: " in record["error"], record


def test_a_kernel_one_platform_cannot_lower_is_recorded_with_why():
    """A Pallas kernel written with a TPU-only operation (`pltpu.roll`, a lane rotation) lowers
    for TPU but not for CUDA: the export fails, naming the operation."""
    def rolled(x_ref, out_ref):
        out_ref[...] = pltpu.roll(x_ref[...], shift=1, axis=1)

    program = ExportingJit(lambda x: pl.pallas_call(rolled, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x), {})
    start = len(RECORDS)
    jax.export.export(program.jitted, platforms=["tpu"])(jnp.ones((8, 128)))  # (for TPU alone it lowers)
    with pytest.raises(ValueError, match="interpret mode"):  # (and runs nowhere here: compiled, not interpreted)
        program(jnp.ones((8, 128)))
    (record,) = RECORDS[start:]
    assert record["platforms"] == ["tpu"] and record["error"].startswith("cuda: ") and "roll" in record["error"], record


def test_only_the_library_and_the_demos_programs_are_wrapped():
    """A program jitted outside `jaxformer` and `train` (here, in a test; in optax or flax) is
    jax's own; one jitted in the library is wrapped, as a decorator with options too."""
    assert not isinstance(exporting_jit(jnp.sin), ExportingJit)
    scope = {"exporting_jit": exporting_jit, "__name__": "jaxformer.example"}
    exec("program = exporting_jit(static_argnames='n')(lambda x, n: x * n)", scope)
    assert isinstance(scope["program"], ExportingJit) and scope["program"].static_names == {"n"}


KERNEL_CALLS = {"cuda": CUDA_CUSTOM_CALL_TARGETS[0], "tpu": "tpu_custom_call"}
# docs/long_context.md's way ("Exporting a program"): Triton's custom call let through by name.
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(target) for target in CUDA_CUSTOM_CALL_TARGETS]


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_kernels_are_in_the_programs_exported(platform, sinks):
    """A model that attends in blocks, with heads both kernels take (128 channels): its training
    step carries the flash kernels (forward, dQ, dK/dV per layer) and its decoding step the
    ragged decoding kernel, for each platform; on the CPU the same programs run the `jnp` path.
    With gpt-oss's sinks too (the kernels take them; their gradient is no kernel of its own)."""
    config = DecoderConfig(vocab_size=256, n_layer=2, n_head=8, n_kv_head=2, d_model=1024, max_seq_len=2048,
                           attention_impl="blocks", dtype="bfloat16")
    config = with_sinks(config) if sinks else config
    model = Decoder(config)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]

    def loss(params, tokens):
        hidden, _ = model.apply({"params": params}, tokens, hidden=True)
        return chunked_cross_entropy(hidden, tokens, model.output_head(params))

    def step(params, tokens, cache):
        return Decoder(config.replace(attention_impl="auto")).apply({"params": params}, tokens, cache)

    def exported(program, *args):
        return jax.export.export(jax.jit(program), platforms=[platform],
                                 disabled_checks=DISABLED_CHECKS)(*args).mlir_module()

    train = exported(jax.grad(loss), params, jax.ShapeDtypeStruct((1, 2048), jnp.int32))
    cache = jax.eval_shape(lambda: KVCache.create(config, 4, 2048))
    decode = exported(step, params, jax.ShapeDtypeStruct((4, 1), jnp.int32), cache)
    assert train.count(KERNEL_CALLS[platform]) == 2 * 3  # each layer's forward, dQ and dK/dV kernels
    assert decode.count(KERNEL_CALLS[platform]) >= 1  # (the layers call one jitted kernel function)
    assert KERNEL_CALLS["tpu" if platform == "cuda" else "cuda"] not in train + decode


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_grouped_matmul_kernels_are_in_the_programs_exported(platform):
    """A model whose layers are experts, in bfloat16, at widths both grouped-matmul kernels take
    (256 by 128): its training step carries each layer's three products as the kernels, forward,
    dx and dw (`kernels.grouped_matmul`), and its decoding step the forward ones, for each
    platform; on the CPU the same programs multiply in blocks (`grouped.in_blocks`). The kernels
    are a jitted function, lowered once per shape (d by F, and F by d for the down projection) and
    called by each product."""
    config = DecoderConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=256, max_seq_len=128,
                           dtype="bfloat16")
    config = config.replace(layers=tuple(dataclasses.replace(spec, ffn=ExpertsSpec(8, 2, 128))
                                         for spec in layer_specs(config)))
    model = Decoder(config)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]

    def loss(params, tokens):
        hidden, _ = model.apply({"params": params}, tokens, hidden=True)
        return chunked_cross_entropy(hidden, tokens, model.output_head(params))

    def step(params, tokens, cache):
        return model.apply({"params": params}, tokens, cache)

    def kernels(program, *args) -> tuple[Counter, int, str]:
        """The kernels lowered, by name; the calls of the jitted function; the module's text."""
        text = jax.export.export(jax.jit(program), platforms=[platform], disabled_checks=DISABLED_CHECKS)(
            *args).mlir_module()
        return Counter(re.findall(r'name = "(grouped_matmul\w*)"', text)), text.count("call @grouped_matmul"), text

    train, train_calls, train_text = kernels(jax.grad(loss), params, jax.ShapeDtypeStruct((2, 64), jnp.int32))
    cache = jax.eval_shape(lambda: KVCache.create(config, 4, 128))
    decode, decode_calls, decode_text = kernels(step, params, jax.ShapeDtypeStruct((4, 1), jnp.int32), cache)
    assert train == {"grouped_matmul": 2, "grouped_matmul_dx": 2, "grouped_matmul_dw": 2}
    assert train_calls == 2 * 3 * 2  # each layer's gate, up and down: forward, and dx and dw together
    assert decode == {"grouped_matmul": 2} and decode_calls == 2 * 3
    assert "ragged_dot" not in train_text + decode_text
    assert KERNEL_CALLS["tpu" if platform == "cuda" else "cuda"] not in train_text + decode_text


def test_a_cached_decoding_step_exports_for_cuda_as_the_docs_say():
    """The public `Decoder`'s cached one-token step, exported for "cuda" exactly as
    docs/long_context.md shows: plain, it is refused for its Triton decoding kernel (so the
    argument is needed); with `disabled_checks` naming `CUDA_CUSTOM_CALL_TARGETS` it exports,
    and every target it names is one the program calls (the list is not stale)."""
    config = DecoderConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=128, max_seq_len=512)
    model = Decoder(config)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    cache = jax.eval_shape(lambda: model.init_cache(4, 512))

    def step(params, tokens, cache):
        return model.apply({"params": params}, tokens, cache)

    args = (params, jax.ShapeDtypeStruct((4, 1), jnp.int32), cache)
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(jax.jit(step), platforms=["cuda"])(*args)
    exported = jax.export.export(
        jax.jit(step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target) for target in CUDA_CUSTOM_CALL_TARGETS],
    )(*args)
    assert exported.platforms == ("cuda",)
    assert all(f"@{target}(" in exported.mlir_module() for target in CUDA_CUSTOM_CALL_TARGETS)
    assert jax.export.export(jax.jit(step), platforms=["tpu"])(*args).platforms == ("tpu",)  # (nothing to disable)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_quantized_model_exports_with_each_platforms_products(platform):
    """Quantized matrices (the embedding and head too) in a forward and in QLoRA's gradient: each
    product's `lax.platform_dependent` lowers its platform's branch. int8: every matrix an int8 x
    int8 product summed in int32 (W8A8, qwix's einsum: 7 matrices a layer and the head); NF4 the
    matrix dequantized where the product reads it, with none of the CPU's loop over blocks."""
    from jaxformer.lora import Adapted, LoraConfig, init_lora
    from jaxformer.quantized import Quantization, quantize_params
    from jaxformer.sharding import param_axes

    config = DecoderConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=128, max_seq_len=64)
    model = Decoder(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    for fmt in ("int8", "nf4"):
        params = jax.eval_shape(lambda p, fmt=fmt: quantize_params(p, param_axes(model), Quantization(fmt, head=True)),
                                shapes)
        text = jax.export.export(jax.jit(lambda p, t: model.apply({"params": p}, t)), platforms=[platform])(
            params, tokens).mlir_module()
        dots = re.findall(r"stablehlo.dot_general.*", text)
        integer = sum("xi8>" in dot and "xi32>" in dot for dot in dots)
        assert integer == (2 * 7 + 1 if fmt == "int8" else 0), (fmt, integer)
        assert "stablehlo.while" not in text
    lora_config = LoraConfig()
    adapted = Adapted(Decoder(config.replace(lora=lora_config)))
    lora = jax.eval_shape(lambda: init_lora(shapes, lora_config, jax.random.key(0)))

    def loss(lora, base, tokens):  # (the NF4 base's: QLoRA's gradient for the adapters alone)
        return jnp.mean(adapted.apply({"params": {"base": base, "lora": lora}}, tokens)[0])

    exported = jax.export.export(jax.jit(jax.grad(loss)), platforms=[platform])(lora, params, tokens)
    assert exported.platforms == (platform,)
