"""Shared fixtures: the reference's small test model, a numpy reference forward, and a
command line run in this process."""

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxformer import Decoder, DecoderConfig, label_smoothed_cross_entropy
from jaxformer.layers import layer_specs

# The tests compare float32 numbers at float32 tolerances. CPUs compute float32 matmuls
# exactly so; GPUs (TF32) and TPUs (bf16 passes) do not unless asked to.
jax.config.update("jax_default_matmul_precision", "highest")
# Most of the suite's time is XLA compiling programs that then run for milliseconds: compile
# them without LLVM's optimisation of the generated code (here, and in the subprocesses the
# tests start). XLA's HLO passes still run, so a test that reads the compiled HLO sees the
# program users get; a comparison that float32 rounding could tip is made in float64. The
# `optimized_programs` fixture compiles a test's programs exactly as users get them.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_NO_OPTIMISATIONS = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
jax.config.update("jax_disable_most_optimizations", _NO_OPTIMISATIONS)
# XLA:CPU's older elementwise emitters compile small programs faster than its MLIR fusion
# emitters (eager operations about 2x). XLA reads the flag when the backend starts; set it
# in XLA_FLAGS yourself to choose otherwise, as JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns the
# passes back on for a whole run.
# (Not where a GPU or TPU plugin is installed: an XLA that does not know the flag aborts as the
# backend starts, and the flag matters on a CPU only.)
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and not any(
        dist.metadata["Name"].lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm", "libtpu"))
        for dist in importlib.metadata.distributions()):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
# The demos keep compiled programs on disk; tests keep theirs out of the user's cache.
_OWN_CACHE_DIR = None  # made by this process (not inherited from the pytest that started it): removed at the end
if "JAXFORMER_CACHE_DIR" not in os.environ:
    _OWN_CACHE_DIR = os.environ["JAXFORMER_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxformer-test-xla-")
# The same directory serves the tests themselves: a program compiled once in this run (by a
# test, a demo run in-process, a subprocess, another pytest-xdist worker) is read back
# rather than compiled again. A fresh directory per run: nothing from an earlier run.
# (In the environment too, for the subprocesses.)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXFORMER_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

# A small decoder: 3 layers, 4 query heads sharing 2 kv heads, d_model 64.
SMALL = DecoderConfig(vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64, max_seq_len=64)


def import_peer(module: str):
    """A peer package for a parity test, or a skip that says how to get it."""
    return pytest.importorskip(module, reason=f"{module} is missing: the parity tests need the peers extra, "
                                              f"pip install -e '.[peers]'")


def init_params(config: DecoderConfig, seed: int = 0):
    """The reference init of `config`: computed once per process, each call given its own
    dicts around the shared arrays."""
    return jax.tree.map(lambda x: x, _init_params(config, seed))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """JAX's in-memory caches emptied after each test file. Every program XLA:CPU compiles
    stays mapped in the process while a cache holds it, a few memory maps each, and a
    pytest-xdist worker runs hundreds of files: past Linux's limit of 65,530 maps a process
    (`vm.max_map_count`) the next compile crashes the worker. A later file that needs a
    program again reads it back from the run's compilation cache on disk."""
    yield
    jax.clear_caches()


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


# The files whose time is longest, most of it one piece a worker cannot share: a process of
# their own (test_sharding.py's 8 devices), a module fixture, or many compiles. With
# `--dist loadfile` a file goes to one worker whole; these are handed out first, in this order
# (pyproject's `--no-loadscope-reorder`: else pytest-xdist hands out the files with the most
# tests first, and these one-test files ran last, one worker idle beside the longest), so that
# they run beside the many short files rather than alone at the end. Two workers start on the
# first two, then take the next two: the OLMoE-shaped decode (15 GB) runs beside the
# eight-device process, and the 1B tests after it.
LONGEST_FIRST = ("tests/test_sharding.py", "tests/test_real_size_experts.py", "tests/test_real_size.py",
                 "tests/training/test_processes.py",
                 "tests/test_docs.py", "tests/serving/test_engine.py", "tests/serving/test_app.py",
                 "tests/decoding/test_speculative.py", "tests/test_decoder.py", "tests/families/test_families.py")


# The full tier (`pytest -m full`), besides what a file marks `full` itself (the real
# sizes): the tests that start processes, run the demos and benchmarks end to end, or span
# meshes of 8 devices. `pytest` alone runs the rest: every module's core checks, in minutes.
FULL_TIER = {
    "tests/test_quantized.py::test_a_model_dequantizes_one_matrix_at_a_time[nf4]": "a second 8-layer compile",
    # (The fast tier keeps NF4's QLoRA gradient without remat; these are the other formats and remat.)
    "tests/test_quantized.py::test_a_qlora_step_dequantizes_one_matrix_at_a_time_in_its_backward_too[int":
        "more 8-layer gradients compiled",
    "tests/test_quantized.py::test_a_qlora_step_dequantizes_one_matrix_at_a_time_in_its_backward_too[nf4-remat]":
        "more 8-layer gradients compiled",
    "tests/commands/test_finetune.py::test_qlora_trains_adapters": "a QLoRA run end to end, merged",
    "tests/test_lora.py::test_a_qlora_step_is_loras_step_on_the_dequantized_base[experts": "a MoE step, per format",
    "tests/convert/test_shipped_quantized.py::test_a_shipped_checkpoint_is": "whole MoE models compiled, per format",
    "tests/convert/test_shipped_quantized.py::test_a_shipped_checkpoint_equals": "transformers' dequantized peer",
    "tests/convert/test_shipped_quantized.py::test_save_hf_as_shipped_is": "transformers' peer, two folders a format",
    "tests/convert/test_quantize_on_load.py::test_every_format_family_and_form": "ten more loads, each compiled",
    "tests/convert/test_quantized_accuracy.py": "a model trained by the demo, then measured in five formats",
    # (The commands' --quantize: the fast tier keeps perplexity's, the adapter's and the server's load.)
    "tests/commands/test_quantize_flags.py::test_generate_int8_prints": "the decoding programs compiled three times",
    "tests/commands/test_quantize_flags.py::test_generate_end_to_end": "a process of its own",
    "tests/test_quantized.py::test_mxfp4_is_decoded_as_transformers_decodes_it": "torch imported for the peer",
    "tests/test_export.py::test_a_quantized_model_exports": "two formats' programs and QLoRA's lowered twice",
    "tests/test_constants.py": "every user path compiled in a process of its own",
    "tests/test_sharding.py::test_sharding_cases_on_eight_devices": "meshes of 8 devices",
    "tests/benchmarks/": "the benchmarks run small, end to end",
    "tests/serving/test_app.py": "the server started, with concurrent clients",
    "tests/serving/test_tools.py::test_a_model_that_calls_a_tool": "a model trained to call a tool, served",
    "tests/serving/test_lm_eval.py": "lm-eval against the server started, and against transformers",
    # (Groups of rows in one call, on each layout; the fast tier keeps the engine's fused steps, test_engine.py.)
    "tests/test_decoder.py::test_groups_of_rows_in_one_call_equal_their_calls_apart[full]": "more layouts",
    "tests/test_decoder.py::test_groups_of_rows_in_one_call_equal_their_calls_apart[rings]": "more layouts",
    "tests/test_decoder.py::test_groups_of_rows_in_one_call_equal_their_calls_apart[scanned]": "more layouts",
    "tests/test_decoder.py::test_groups_of_rows_in_one_call_equal_their_calls_apart[qk-norm": "more layouts",
    "tests/test_cache.py::test_with_steps_of_copies_back_what_a_step_of_the_first_rows_wrote[rings]": "more layouts",
    "tests/test_cache.py::test_with_steps_of_copies_back_what_a_step_of_the_first_rows_wrote[stacked]": "more layouts",
    # (The fast tier keeps a step at its span on the plain layout and on scanned sliding and full layers.)
    "tests/decoding/test_spans.py::test_a_step_at_its_span_gives_the_full_capacity_logits[None-True]":
        "more layouts",
    "tests/decoding/test_spans.py::test_a_step_at_its_span_gives_the_full_capacity_logits[layer_types2-False]":
        "more layouts",
    # (The fast tier keeps the stacked cache against the unrolled one on the GQA layout.)
    "tests/test_scan.py::test_cached_decoding_equals_the_unrolled_cache[mha-untied-bias]": "more layouts",
    "tests/test_scan.py::test_cached_decoding_equals_the_unrolled_cache[mqa-interleaved]": "more layouts",
    # (The fast tier keeps both proposers on each of the three configs; these are the other k.)
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[gqa-split-half-tied-lookup-3]": "more k",
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[mqa-split-half-untied-draft-6]": "more k",
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[mha-interleaved-untied-lookup-7]":
        "more k",
    "tests/faults/test_hostile_server.py": "servers started, signalled and loaded",
    "tests/faults/test_inputs.py::test_cli_killed_": "commands killed mid-run, then resumed",
    # (Peers at length: the fast tier keeps each family's logits against transformers, and LoRA's step
    # against peft on Llama; whole greedy runs and the other families' LoRA steps here.)
    "tests/families/test_families.py::test_greedy_tokens_equal_transformers": "greedy runs against transformers",
    "tests/convert/test_hf_parity.py::test_greedy_generation_matches_token_for_token": "greedy runs, transformers",
    "tests/test_lora.py::test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways[gemma]": "more families",
    "tests/test_lora.py::test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways[phi3]": "more families",
    "tests/faults/test_runs.py": "runs started, raced and interrupted",
    "tests/faults/test_interrupts.py": "commands interrupted by signals",
    "tests/faults/test_hostile_finetune.py": "fine-tuning runs raced and refused",
    "tests/faults/test_disks.py": "runs on disks that fill up",
    "tests/train/": "the demos end to end",
    "tests/training/test_processes.py": "runs of 2 processes on loopback",
    "tests/test_export.py::test_every_program_exports": "every user path run, each program exported for cuda and tpu",
    "tests/test_export.py::test_the_programs_exported_are_those_listed": "every user path run and exported",
    "tests/test_export.py::test_each_entry_point_is_exported": "every user path run and exported",
    "tests/training/test_state.py::test_initial_parameters_compiled_as_a_runs_are_the_default_compiles_bits":
        "initial parameters compiled at XLA's full optimisation",
}
# Cached decoding against transformers' own, step by step: the fast tier keeps a plain family and two
# of the parity file's layouts (rings and windows keep their cached decoding there in test_cache.py,
# soft-capped attention in the decoding kernels' tests, tests/kernels); the others here.
FULL_TIER.update({f"tests/families/test_families.py::test_cached_decoding_equals_transformers_and_the_full_forward"
                  f"[{family}]": "more families" for family in (
                      "Qwen3-0.6B", "Mistral-7B-v0.1", "gemma-2b", "gemma-2-2b", "gemma-3-1b-it",
                      "Phi-3-mini-4k-instruct", "Phi-3 longrope", "Qwen2.5-0.5B", "SmolLM2-135M", "Qwen3-30B-A3B",
                      "Mixtral-8x7B-v0.1",
                      "Qwen1.5-MoE-A2.7B", "OLMoE-1B-7B-0924")})
# Mixtures of experts: the fast tier keeps the layer against transformers' modules for every family's
# routing (tests/test_experts.py) and each routing feature's guard, the grouped products against a loop
# and their gradients, one family's logits against transformers (OLMoE), Qwen3-MoE's and gpt-oss's
# save_hf, a mixture's cached steps against its full forward, the experts' adapters in both grouped
# products against the formula and their merge, gpt-oss's attention layer against transformers', the
# harmony chat token for token, and each kernel in float32 in the interpreter; the rest here.
FULL_TIER.update({
    **{f"tests/families/test_families.py::test_logits_equal_transformers_and_each_feature_counts[{family}]":
       "more families of experts" for family in ("Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B", "gpt-oss-20b")},
    "tests/test_lora.py::test_lora_on_the_experts_equals_peft_one_step_and_the_adapter_files_go_both_ways":
        "the experts' LoRA against peft",
    "tests/decoding/test_generation.py::test_a_row_of_a_mixture_of_experts_decodes_alone_as_in_a_batch":
        "a mixture's rows alone and in a batch",
    "tests/test_experts.py::test_expert_load_counts_each_layers_own_routing_in_model_order": "the report's load",
    "tests/test_experts.py::test_expert_parallel_on_a_one_device_mesh_is_the_plain_layer[capacity]":
        "expert parallelism with a capacity",
    "tests/test_experts.py::test_ties_take_the_lower_index[gpt_oss]": "more ties",
    "tests/test_lora.py::test_routed_adds_each_experts_adapter_in_both_grouped_products[None]": "more layouts",
    "tests/decoding/test_speculative.py::test_greedy_on_a_mixture_of_experts_gives_generates_tokens":
        "speculative decoding over experts",
    "tests/text/test_perplexity.py::test_a_mixture_of_experts_perplexity_is_the_formula_and_the_commands":
        "a mixture's perplexity",
    "tests/text/test_conventions.py::test_a_harmony_chat_stops_at_return_and_at_call": "the harmony convention's runs",
    # (Sinks: the fast tier keeps each platform's paths with sinks, which run every path the plain ones do.)
    **{f"tests/test_attention.py::test_each_platforms_paths_run_in_the_kernels_interpreter_equal_the_cpus"
       f"[{case}-no sinks]": "more cases" for case in ("cuda-bfloat16", "tpu-float32")},
    **{f"tests/test_export.py::test_the_kernels_are_in_the_programs_exported[{platform}-]": "more cases"
       for platform in ("cuda", "tpu")},
    "tests/test_blockwise.py::test_a_decoder_attending_in_blocks_equals_the_dense_one_and_its_gradients"
    "[scanned, sinks]": "more layouts",
    **{f"tests/families/test_families.py::test_save_hf_writes_the_family_that_transformers_reopens[{family}]":
       "more families of experts" for family in ("Mixtral-8x7B-v0.1", "Qwen1.5-MoE-A2.7B", "OLMoE-1B-7B-0924")},
    "tests/families/test_families.py::test_cached_decoding_equals_transformers_and_the_full_forward[gpt-oss-20b]":
        "a mixture's cached decoding against transformers",
    "tests/text/test_conventions.py::test_greedy_text_is_transformers_and_stops_at_each_stop_id[gpt-oss]":
        "the harmony convention's runs",
    "tests/text/test_conventions.py::test_a_chat_with_prompt_lookup_is_transformers_greedy[gpt-oss]":
        "the harmony convention's runs",
    "tests/text/test_conventions.py::test_gpt_oss_whole_template_with_tools_is_apply_chat_templates":
        "the harmony template with tools",
    "tests/commands/test_finetune.py::test_lora_on_a_mixture_of_experts_trains_its_targets_and_merges":
        "a mixture's LoRA runs",
    "tests/commands/test_finetune.py::test_peft_opens_the_adapters_of_a_mixture_of_experts_on_transformers":
        "a mixture's LoRA runs, opened by peft",
    "tests/test_lora.py::test_lora_on_the_experts_equals_peft_one_step_and_the_adapter_files_go_both_ways[gpt_oss]":
        "the experts' LoRA against peft on another family",
    "tests/decoding/test_beam_search.py::test_beam_search_on_a_mixture_of_experts": "beams over experts",
    "tests/serving/test_engine.py::test_a_mixture_of_experts_serves_each_request_what_it_gets_alone":
        "the engine's batching over experts",
    "tests/kernels/test_grouped_matmul.py::test_bfloat16_within_one_rounding": "the kernels in bfloat16",
    # (Mixtral routes as Qwen3-MoE does, over Mistral's attention: both keep their fast-tier tests.)
    "tests/families/test_families.py::test_logits_equal_transformers_and_each_feature_counts[Mixtral-8x7B-v0.1]":
        "more families of experts",
    # (The fast tier exports a model of experts for cuda; the kernels lower for tpu in tests/kernels.)
    "tests/test_export.py::test_the_grouped_matmul_kernels_are_in_the_programs_exported[tpu]": "another platform",
    **{f"tests/kernels/test_grouped_matmul.py::test_float32_equals_in_blocks_a_loop_and_the_dense_gradients"
       f"[{platform}-{case}]": "more layouts" for platform in ("triton", "mosaic") for case in ("tiles", "capacity")},
})
# SmolLM3, OLMo 2 and OLMo 3: the fast tier keeps OLMo 3's logits against transformers, scanned too, with each
# feature's guard (the norms after each sublayer, q/k norms over the projection, its windows, YaRN on its full
# layers alone), and the layer features against the float64 forward, scanned too (tests/test_layers.py: NoPE
# layers, the "post" norms); the other two's logits, the three's cached decoding and save_hf, and OLMo 2's LoRA
# against peft here (their greedy runs with every family's, above).
FULL_TIER.update({
    **{f"tests/families/test_families.py::test_logits_equal_transformers_and_each_feature_counts[{family}]":
       "more families" for family in ("SmolLM3-3B", "OLMo-2-1124-7B")},
    **{f"tests/families/test_families.py::{test}[{family}]": "more families"
       for test in ("test_cached_decoding_equals_transformers_and_the_full_forward",
                    "test_save_hf_writes_the_family_that_transformers_reopens")
       for family in ("SmolLM3-3B", "OLMo-2-1124-7B", "Olmo-3-1025-7B")},
    "tests/test_lora.py::test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways[olmo2]": "more families",
})
# (A mixture's fine-tuning run end to end; the fast tier keeps the layer's load-balancing loss against
# transformers', tests/test_experts.py, and dense fine-tuning's runs.)
FULL_TIER["tests/commands/test_finetune.py::test_a_mixture_of_experts_trains_with_its_load_balancing_loss"] = \
    "a mixture's fine-tuning run"
# Gemma 4: the fast tier keeps its config.json read in both forms, its refusals, its published sizes, a tiny
# E2B's logits against transformers (per-layer inputs, shared keys and values, the wider global heads and their
# proportional RoPE: tests/families/test_gemma4.py) and a cache over layers of their own heads whose last ones
# share keys and values (tests/test_layers.py); every family test of both checkpoints, the image-text checkpoint,
# the experts' load, and the layers' other cases here.
FULL_TIER.update({
    **{f"tests/families/test_families.py::{test}[{family}]": "Gemma 4 against transformers at length"
       for test in ("test_logits_equal_transformers_and_each_feature_counts", "test_greedy_tokens_equal_transformers",
                    "test_cached_decoding_equals_transformers_and_the_full_forward",
                    "test_save_hf_writes_the_family_that_transformers_reopens")
       for family in ("gemma-4-E2B-it", "gemma-4-26B-A4B-it")},
    "tests/families/test_gemma4.py::test_an_image_text_checkpoint_loads_its_text_model_and_saves_it_as_gemma4_text":
        "Gemma 4's image-text checkpoint",
    "tests/families/test_gemma4.py::test_the_experts_beside_each_mlp_report_their_load": "Gemma 4's experts' load",
    "tests/test_layers.py::test_layers_of_their_own_head_widths_and_shared_keys_decode_through_the_cache_as_the_full_"
    "forward[own]": "more layouts",
    "tests/test_layers.py::test_a_scanned_model_of_per_layer_head_widths_stacks_one_shape_per_kind": "more layouts",
})
# (LoRA on the newer mixers: the fast tier keeps which layers each target adapts, the refusals, and Qwen3-Next's
# grouped rows into peft's files and back, test_a_target_adapts_the_layers_whose_module_it_names.)
FULL_TIER["tests/test_lora_mixers.py::test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways"] = \
    ("Qwen3.5's, Qwen3.5-MoE's, Qwen3-Next's, DeepSeek-V3's, Kimi K2's and DeepSeek-V2-Lite's LoRA against peft "
     "(~1 min each)")
FULL_TIER["tests/test_lora_mixers.py::test_an_image_text_checkpoints_adapters_go_both_ways"] = \
    "Qwen3.5's image-text adapters against peft"
FULL_TIER["tests/commands/test_finetune.py::test_lora_on_a_hybrid_trains_its_linear_and_attention_layers_adapters"] = \
    "a hybrid's fine-tuning run"
# Variants whose test stays in the fast tier on its other parametrisations: speculative greedy keeps
# a proposer on each config, lookup on gqa and mha, a draft model of its own on mqa (the gqa model as its
# own draft: the file's other tests); vanilla's cached greedy is in the full tier on each model (the
# cached steps: test_cached_steps_equal_teacher_forcing).
FULL_TIER.update({
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[gqa-split-half-tied-draft-8]":
        "more proposers",
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[mha-interleaved-untied-draft-2]":
        "more proposers",
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[mqa-split-half-untied-lookup-8]":
        "more proposers",
    "tests/text/test_perplexity.py::test_a_mixture_of_experts_perplexity_equals_transformers":
        "transformers' mixture of experts",
    "tests/test_vanilla.py::test_cached_greedy_equals_uncached[True-False]": "more layouts",
    "tests/test_vanilla.py::test_cached_greedy_equals_uncached[False-True]": "more layouts",
})
FULL_TIER.update({f"tests/convert/test_hf_parity.py::test_cached_decoding_logits_match_at_every_step[{layout}]":
                  "more layouts" for layout in ("llama-untied", "llama-mqa", "mistral", "qwen2")})
FULL_TIER.update({
    # (The fast tier keeps each family's scanned logits against transformers, tests/families/test_families.py,
    # and the scanned model's tokens against the unrolled one's, test_scan.py.)
    "tests/test_scan.py::test_scanned_model_matches_transformers": "the scanned model against transformers again",
    # (The fast tier keeps the periodic layout: segments of one body and of two, rings in two stacks.)
    "tests/test_scan.py::test_segments_of_differing_layers_compute_the_unrolled_model[widths]": "more layouts",
    # (The fast tier keeps the jitted variant, and the untraced forward.)
    "tests/test_decoder.py::DecoderVariantsTest::test_prefill_then_steps_equals_full_forward__without_jit":
        "the cached steps untraced",
})
FULL_TIER.update({
    # The docs' longer examples: a mesh, the demos' recipes, the engine and speculative decoding as the docs
    # show them (the fast tier keeps the README's blocks and the docs' short ones; each of these paths has its
    # module's tests there: test_sharding, tests/training, tests/serving/test_engine, test_speculative).
    **{f"tests/test_docs.py::test_python_block_runs[docs/{block}]": "the docs' longer examples"
       for block in ("sharding.md::mesh", "sharding.md::mesh-training", "sharding.md::experts",
                     "training.md::reverse-recipe", "training.md::train-your-own", "serving.md::engine",
                     "decoding.md::speculative", "decoding.md::encoder-decoder")},
    # (The fast tier keeps the product's own temporaries against its weight's, the test above it.)
    "tests/test_products.py::test_a_bfloat16_decoding_run_holds_no_float32_copy_of_the_weights":
        "a whole decoding run compiled with XLA's optimisations",
    # (The fast tier keeps the draft model's chi-square test.)
    "tests/decoding/test_speculative.py::test_sampling_keeps_the_models_distribution[lookup]": "more proposers",
    # (The fast tier keeps remat's gradients in the scanned decoder, test_scan.py.)
    "tests/test_lora.py::test_remat_recomputes_the_same_gradients": "remat again, with adapters",
    # (The fast tier keeps greedy, sampling, the stream and the engine across spans.)
    "tests/decoding/test_spans.py::test_beam_search_and_prompt_lookup_across_spans_keep_their_tokens":
        "more strategies across spans",
    # (The fast tier keeps speculative decoding's rounds, and a plain stream's, tests/decoding/test_spans.py.)
    "tests/decoding/test_speculative.py::test_stream_gives_the_same_tokens": "more strategies streamed",
    # (The fast tier keeps the scanned layout.)
    "tests/test_blockwise.py::test_a_decoder_attending_in_blocks_equals_the_dense_one_and_its_gradients[layers]":
        "more layouts",
    # (The fast tier keeps the bfloat16 load.)
    "tests/convert/test_load_memory.py::test_sharded_bf16_loads_within_1_3x_the_weights[float32-scanned]":
        "more layouts",
    # (The fast tier keeps each refusal of a run directory in the library, tests/training/test_run_dir.py
    # and test_loop.py; here the commands refuse a real finished run's damaged copies, one line each.)
    "tests/faults/test_inputs.py::test_cli_refuses_a_run_dir_in_one_line_and_changes_nothing":
        "a finished run's directory, damaged, refused by the commands",
    # (The fast tier keeps the engine's fused steps, tests/serving/test_engine.py.)
    "tests/test_decoder.py::test_groups_of_rows_in_one_call_equal_their_calls_apart[scanned-rings]": "more layouts",
    # (The fast tier keeps vanilla's cached steps against teacher forcing.)
    "tests/test_vanilla.py::test_cached_greedy_equals_uncached[False-False]": "more layouts",
})
# Latent attention (MLA): the fast tier keeps the layer against transformers' DeepseekV3Attention (q_lora_rank,
# interleaved RoPE, DeepSeek-V3's YaRN), a decoder of latent layers decoding over its latent cache (absorbed) as
# its full forward (expanded), and the cache's size; the other configurations, the layer's absorbed form in
# pieces, with LoRA and over a window, and the scanned decoder here.
FULL_TIER.update({
    **{f"tests/test_latent_attention.py::test_the_layer_equals_transformers_deepseek_attention[{case}]":
       "more configurations" for case in ("v3-k2-yarn-no-q-lora", "v3-unequal-mscales", "v2-lite",
                                          "v2-q-lora-plain-rope")},
    "tests/test_latent_attention.py::test_absorbed_decoding_over_the_latent_cache_equals_the_expanded_form":
        "more layouts",
    "tests/test_latent_attention.py::test_a_decoder_of_latent_layers_decodes_over_its_cache_as_its_full_forward"
    "[scanned]": "more layouts",
    # (DeepSeek's families, whose layers, routing and cache the tests above keep fast: their logits against
    # transformers with each feature's guard, 16-19 s for DeepSeek-V3's, here; tests/families/test_deepseek.py's
    # reading of their fields stays fast.)
    **{f"tests/families/test_families.py::test_logits_equal_transformers_and_each_feature_counts[{family}]":
       "latent-attention families" for family in ("DeepSeek-V3", "Kimi-K2-Instruct", "DeepSeek-V2-Lite")},
    **{f"tests/families/test_families.py::{test}[{family}]": "latent-attention families at length"
       for test in ("test_cached_decoding_equals_transformers_and_the_full_forward",
                    "test_save_hf_writes_the_family_that_transformers_reopens")
       for family in ("DeepSeek-V3", "Kimi-K2-Instruct", "DeepSeek-V2-Lite")},
})
# The grouped-matmul kernels interpreted at the widest case, 4-16 s each (the fast tier keeps every other case on
# both kernels, in float32 and in bfloat16).
FULL_TIER.update({f"tests/kernels/test_grouped_matmul.py::{test}[{platform}-wide]": "the kernels interpreted, wider"
                  for test in ("test_float32_equals_in_blocks_a_loop_and_the_dense_gradients",
                               "test_bfloat16_within_one_rounding") for platform in ("triton", "mosaic")})
# The chunked loss's 120 cases (chunk size x head layout x ignore_id x smoothing, a compile each): the fast tier
# keeps 20, every value of each parameter beside every value of each other one (case k = chunk + layout, by index, takes
# ignore_id k % 3 and smoothing k % 2); the other 100 here.
FULL_TIER.update({
    f"tests/test_losses.py::test_chunked_equals_the_whole_logits_loss_and_the_float64_formula"
    f"[{chunk}-{ignore_id}-{smoothing}-{tied}-{softcap}]": "more combinations"
    for c, chunk in enumerate([None, 1, 4, 21, 50])
    for h, (tied, softcap) in enumerate([(True, None), (False, None), (True, 2.0), (False, 2.0)])
    for i, ignore_id in enumerate([None, -100, 0]) for e, smoothing in enumerate([0.0, 0.1])
    if (i, e) != ((c + h) % 3, (c + h) % 2)})


# Variants of the fast tier's tests whose paths its other variants and other modules' tests keep there:
FULL_TIER.update({
    # (The scanned decoder's logits and loss: test_scan.py; the adapters': test_lora.py.)
    **{f"tests/test_decoder.py::test_hidden_states_and_output_head_give_the_logits_and_the_loss[changes{i}]":
       "more layouts" for i in (2, 3)},
    # (The fast tier keeps the tied and Qwen2 layouts and Llama 3.2's; Mistral and Llama untied are families of
    # tests/families/test_families.py too.)
    **{f"tests/convert/test_hf_parity.py::test_logits_match[{peer}]": "more layouts"
       for peer in ("llama-untied", "mistral")},
    # (Each convention's template against apply_chat_template stays:
    # test_prompt_ids_chat_prompts_and_text_are_autotokenizers.)
    **{f"tests/text/test_conventions.py::{test}[{name}]": "more conventions' runs"
       for test in ("test_a_chat_with_prompt_lookup_is_transformers_greedy",
                    "test_greedy_text_is_transformers_and_stops_at_each_stop_id") for name in ("gemma3", "qwen2.5")},
    "tests/faults/test_nonfinite.py::test_stream_raises_at_the_bad_step_with_the_steps_before[draft]": "more proposers",
    **{f"tests/faults/test_nonfinite.py::test_nan_parameters_stop_every_row_at_its_first_token[{case}]":
       "more strategies" for case in ("vanilla-beams", "lookup")},
    # (The fast tier keeps the GQA layout; the others' cached decoding is compared in test_scan.py too.)
    **{f"tests/test_scan.py::test_generate_gives_the_same_tokens[{layout}]": "more layouts"
       for layout in ("mha-untied-bias", "mqa-interleaved")},
    # (Gemma 2 and Gemma 3 stay; SmolLM2 is a Llama.)
    **{f"tests/families/test_families.py::test_logits_equal_transformers_and_each_feature_counts[{family}]":
       "more families" for family in ("gemma-2b", "SmolLM2-135M")},
    **{f"tests/test_docs.py::test_python_block_runs[docs/{block}]": "the docs' longer examples"
       for block in ("decoding.md::beams", "parity.md::rope-pairing", "parity.md::torch-transformer")},
    # (Padded prefill pieces over sliding and full layers: tests/decoding/test_steps.py.)
    "tests/serving/test_engine.py::test_sliding_window_layers_prefilled_in_padded_pieces_decode_as_alone":
        "the engine over sliding layers",
    # (Across spans the fast tier keeps greedy tokens, sampling, the stream and a step on the plain layout.)
    "tests/decoding/test_spans.py::test_the_engine_decodes_across_spans_as_generate_with_a_program_per_span":
        "the engine across spans",
    "tests/decoding/test_spans.py::test_a_step_at_its_span_gives_the_full_capacity_logits[layer_types3-True]":
        "more layouts",
    # (Rings: the fast tier keeps the unscanned stacks.)
    "tests/test_cache.py::test_rings_decode_ragged_prompts_and_speculative_rewinds_as_each_prompt_alone[True]":
        "more layouts",
    "tests/test_cache.py::test_a_row_evicted_and_refilled_decodes_as_its_prompt_alone[True]": "more layouts",
    "tests/decoding/test_speculative.py::test_k_shrinks_to_fit_max_seq_len": "speculative decoding at the edge",
    "tests/decoding/test_speculative.py::test_greedy_gives_generates_tokens[mha-interleaved-untied-lookup-4]":
        "more proposers",
    # (Fine-tuning: the fast tier keeps a LoRA run, its adapters and merged folder, and full fine-tuning.)
    "tests/commands/test_finetune.py::test_resume_mid_run_gives_the_uninterrupted_runs_adapters_bit_for_bit":
        "a fine-tuning run interrupted and resumed",
    "tests/commands/test_finetune.py::test_the_report_knows_a_fine_tuning_run_and_recomputes_its_snapshots":
        "the report of a fine-tuning run",
    # (DPO: the fast tier keeps the loss and TRL's metrics against TRL on two checkpoints, tests/test_dpo.py, and the
    # pairs' tokens against TRL's, tests/text/test_preference.py.)
    "tests/commands/test_finetune_dpo.py::test_a_lora_runs_held_out_metrics_are_trls_with_peft_its_reference_the_base":
        "a DPO run with LoRA, its held-out metrics against TRL with peft",
    # (Processes under a memory limit; the library's estimate and refusal stay, test_untrusted's others.)
    "tests/faults/test_untrusted.py::test_cli_under_an_address_space_limit_refuses_a_long_prompt_in_one_line":
        "commands in processes under an address-space limit",
    "tests/faults/test_untrusted.py::test_a_long_prompt_that_fits_decodes_and_xla_needs_no_more_than_the_estimate":
        "a long prompt decoded",
    "tests/faults/test_exports.py::test_exporting_a_finished_run_changes_nothing_in_the_run_dir":
        "a finished run exported",
    "tests/faults/test_nonfinite.py::test_train_report_rebuilds_a_run_that_diverged": "a diverged run's report",
    "tests/serving/test_prefixes.py::test_a_prompt_beginning_as_a_cached_one_prefills_only_the_rest_and_decodes_the_same"
    "[sliding]": "more layouts",
    "tests/test_blockwise.py::test_memory_grows_linearly_in_blocks_and_as_the_square_dense": "memory at length",
    # (Streams: tests/decoding/test_spans.py and test_generation.py; the command's own: its other tests.)
    "tests/test_scan.py::test_stream_gives_generate_tokens": "more layouts streamed",
    "tests/commands/test_generate.py::test_stream_prints_the_same_text": "the command's stream",
    "tests/commands/test_generate.py::test_prompt_lookup_gives_the_same_text_in_fewer_passes":
        "the command's proposers",
    # (The command's checks: the fast tier keeps five; these two are the decoder's own tests too, test_decoder.py
    # and test_cache.py.)
    **{f"tests/commands/test_selfcheck.py::test_reference_check_passes[{check}]": "more checks"
       for check in ("check_tying_and_shapes", "check_kv_cache")},
    # (The numpy forward keeps GQA, MQA, untied and wider heads; the RoPE pairing and Qwen2's biases have files of
    # their own, tests/convert.)
    **{f"tests/test_decoder.py::test_matches_independent_numpy_forward[changes{i}]": "more layouts" for i in (1, 3, 5)},
    # (Blocks against dense attention: each case with sinks, which computes all the plain case does; plain on GQA.)
    **{f"tests/test_blockwise.py::test_blocks_equal_dense_attention_values_and_gradients[{case}-]": "more cases"
       for case in ("causal, MHA", "padded rows", "queries after a cache", "sliding and softcap", "sliding window",
                    "softcap")},
    # (The kernels in the interpreter: each feature stays on each kernel; these cases are others' combinations.)
    **{f"tests/kernels/test_mosaic_attention.py::test_matches_dense_attention[{case}]": "more cases"
       for case in ("cached-keys", "causal-mha", "padded-rows")},
    **{f"tests/kernels/test_triton_attention.py::test_float32_matches_dense[{case}]": "more cases"
       for case in ("cached", "gqa")},
    **{f"tests/kernels/test_decode_attention.py::test_matches_dense_attention[sliding_mha_partial_block-{platform}]":
       "more cases" for platform in ("mosaic", "triton")},
})

# Gated DeltaNet (tests/test_deltanet.py): the fast tier keeps the chunked form against the recurrent one at one
# token and past three chunks, the Qwen3-Next layer against transformers', and the spec's checks.
FULL_TIER.update({
    **{f"tests/test_deltanet.py::test_the_chunked_form_equals_the_recurrent_one[{T}]": "more lengths"
       for T in ("chunk-1", "chunk", "chunk+1")},
    "tests/test_deltanet.py::test_the_chunked_forms_gradients_equal_the_recurrent_ones": "the two forms' gradients",
    "tests/test_deltanet.py::test_the_unit_lower_inverse_is_the_float64_inverse": "the chunks' inverse alone",
    "tests/test_deltanet.py::test_a_prompt_in_pieces_padded_after_their_ends_equals_it_in_one":
        "states across calls, and padding",
    "tests/test_deltanet.py::test_the_layer_from_its_cache_continues_rows_as_one_call": "the layer's cached path",
    "tests/test_deltanet.py::test_both_forms_equal_transformers_torch_rules": "each form against transformers'",
    "tests/test_deltanet.py::test_the_layer_equals_transformers_gated_deltanet[qwen3_5]": "Qwen3.5's projections",
    "tests/test_deltanet.py::test_the_gated_norm_is_transformers_in_bfloat16": "the gated norm in bfloat16",
})
# (Scanned segments: the fast tier keeps layers of differing widths cut into segments; a period of several bodies
# here, as the hybrids' scanned tests run one.)
FULL_TIER["tests/test_scan.py::test_segments_of_differing_layers_compute_the_unrolled_model[periodic]"] = \
    "segments of a period of bodies"
# The linear-attention hybrids' families (tests/families/test_hybrids.py): the fast tier keeps Qwen3.5's logits
# against transformers (every mixer, the image-text checkpoint's text model, its features' guards) and the refusal
# of speculative decoding; the other families, greedy runs, cached decoding and save_hf here, as the hybrid cache
# through ragged prompts and beams and the engine (tests/test_cache.py keeps a state beside keys in every layout).
FULL_TIER.update({
    **{f"tests/families/test_hybrids.py::{test}[{family}]": "more hybrid families"
       for test in ("test_logits_equal_transformers_and_each_feature_counts",
                    "test_speculative_decoding_is_refused_in_one_line")
       for family in ("Qwen3-Next-80B-A3B-Instruct", "Qwen3.6-35B-A3B")},
    **{f"tests/families/test_hybrids.py::{test}": "hybrid families at length"
       for test in ("test_greedy_tokens_equal_transformers",
                    "test_cached_decoding_equals_transformers_and_the_full_forward",
                    "test_save_hf_writes_the_text_model_that_transformers_reopens")},
    "tests/test_cache.py::test_a_hybrid_cache_decodes_ragged_prompts_and_beams_as_each_prompt_alone":
        "the hybrid cache through decoding",
    "tests/serving/test_prefixes.py::test_a_linear_attention_hybrid_reuses_a_cached_prompt_only_whole":
        "the hybrid cache in the engine",
})
# The new mixers on every other path (the fast tier keeps each one's cached decoding and its cache's layout, above
# and in tests/test_cache.py): meshes (tests/sharding/eight_devices.py, in the full tier already), speculative
# decoding and the engine over latent attention, perplexity and full fine-tuning of a hybrid's and an MLA's folders,
# and their prefills' memory against XLA's count.
FULL_TIER.update({
    "tests/decoding/test_speculative.py::test_greedy_on_latent_attention_gives_generates_tokens": "latent attention",
    "tests/serving/test_engine.py::test_latent_attention_serves_each_request_what_it_gets_alone": "latent attention",
    "tests/test_latent_attention.py::test_ragged_prompts_and_beams_over_the_latent_cache_decode_as_each_prompt_alone":
        "latent attention's cache through ragged rows and beams",
    **{f"tests/text/test_perplexity.py::test_the_new_mixers_perplexity_is_the_formula_and_the_command[{kind}]":
       "the new mixers' folders" for kind in ("latent", "hybrid")},
    **{f"tests/commands/test_finetune.py::test_full_fine_tuning_of_the_new_mixers_lowers_the_loss_and_reloads[{kind}]":
       "the new mixers' folders" for kind in ("latent", "hybrid")},
    # (The fast tier keeps latent attention's dense prefill against XLA's count, 3 s.)
    **{f"tests/faults/test_untrusted.py::test_xla_needs_no_more_than_the_estimate_for_the_new_mixers[{name}]":
       "more mixers" for name in ("linear", "latent-blocks")},
})

# Gemma 4's tiny E2B (GEMMA4_DECODING) on the decoding paths: beam search, sampled steps against the full forward,
# speculative decoding, the engine (its prefix cache too) and perplexity, each compiling the model's programs at
# several shapes; and LoRA against peft on the E2B and the 26B-A4B: 12-70 s each on 2 shared cores.
FULL_TIER.update({
    **{f"{test}[gemma-4-E2B-it": "Gemma 4 on the decoding paths"
       for test in ("tests/decoding/test_beam_search.py::test_beam_search_on_gemma_4",
                    "tests/decoding/test_generation.py::test_gemma_4_sampled_steps_give_the_full_forwards_logits",
                    "tests/decoding/test_speculative.py::test_greedy_on_gemma_4_gives_generates_tokens",
                    "tests/text/test_perplexity.py::test_gemma_4_perplexity_is_the_formula",
                    "tests/serving/test_prefixes.py::test_gemma_4_reuses_a_cached_prompt_and_decodes_the_same",
                    "tests/serving/test_engine.py::test_gemma_4_serves_each_request_what_it_gets_alone")},
    **{f"tests/test_lora_mixers.py::test_lora_on_gemma_4_equals_peft_in_float64[{name}": "Gemma 4's LoRA"
       for name in ("gemma-4-E2B-it", "gemma-4-26B-A4B-it")},
})


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(config, items):
    """The full tier's tests marked `full`; the files of `LONGEST_FIRST` first, in that
    order, the rest as collected."""
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in FULL_TIER):
            item.add_marker(pytest.mark.full)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # (a stable sort)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per CPU this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def memorised_params(config: DecoderConfig, ids: list[int], steps: int = 300, batch: int = 16, width: int = 33):
    """Parameters of `config` that have learned the text of `ids` by heart, so greedy decoding
    continues a prompt with that text: real words, far from ties, not random bytes.

    Trained once per run: the first process to train them (a pytest-xdist worker, or a
    subprocess) leaves them in the run's cache directory, and the others read them back (the
    training is deterministic, so they would get the same numbers; it takes tens of seconds)."""
    key = hashlib.sha256(repr((config, list(map(int, ids)), steps, batch, width)).encode()).hexdigest()[:24]
    path = os.path.join(os.environ["JAXFORMER_CACHE_DIR"], f"memorised-{key}.npz")
    treedef = jax.tree.structure(init_params(config))
    if os.path.exists(path):
        with np.load(path) as saved:
            return jax.tree.unflatten(treedef, [jnp.asarray(saved[f"leaf{i}"]) for i in range(treedef.num_leaves)])
    params = _memorise(config, ids, steps, batch, width)
    partial = f"{path}.{os.getpid()}.npz"
    np.savez(partial, **{f"leaf{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(params))})
    os.replace(partial, path)  # (whole or not at all: another process may be reading)
    return params


def _memorise(config: DecoderConfig, ids: list[int], steps: int, batch: int, width: int):
    model, optimizer = Decoder(config), optax.adam(1e-2)
    ids = jnp.asarray(ids)

    @jax.jit
    def update(params, opt_state, key):
        start = jax.random.randint(key, (batch, 1), 0, ids.shape[0] - width)
        tokens = ids[start + jnp.arange(width)]  # [batch, width]

        def loss(params):
            logits, _ = model.apply({"params": params}, tokens[:, :-1])
            return label_smoothed_cross_entropy(logits, tokens[:, 1:], 0.0)

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    params = init_params(config)
    opt_state = optimizer.init(params)
    for key in jax.random.split(jax.random.key(0), steps):
        params, opt_state = update(params, opt_state, key)
    return params


@functools.cache
def _init_params(config: DecoderConfig, seed: int):
    # Jitted: one compile per config, where the eager init compiles each of its operations.
    return jax.jit(Decoder(config).init)(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32))["params"]


def random_params(config: DecoderConfig, seed: int, scale: float = 0.3):
    """`scaled_random_params` of `config`'s parameter tree: the same values as over its
    initialised parameters, without compiling the init (only its shapes are traced)."""
    shapes = jax.eval_shape(lambda: Decoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    return scaled_random_params(shapes["params"], seed, scale)


def filled_layers(config: DecoderConfig, widths=None, windows=None) -> DecoderConfig:
    """`config` with its derived specs filled in as `layers`, layer i's FFN `widths[i]` wide and
    its attention sliding over `windows[i]` positions (None: full) where given."""
    specs = layer_specs(config)
    widths = widths or [spec.ffn.width for spec in specs]
    windows = windows or [spec.mixer.window for spec in specs]
    return config.replace(layers=tuple(
        dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, width=width),
                            mixer=dataclasses.replace(spec.mixer, window=window))
        for spec, width, window in zip(specs, widths, windows)))


def with_sinks(config: DecoderConfig) -> DecoderConfig:
    """`config` with its specs filled in as `layers` (`layer_specs`), each attention with gpt-oss's
    sinks and output bias."""
    return config.replace(layers=tuple(
        dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, sinks=True, o_bias=True))
        for spec in layer_specs(config)))


def with_experts(config: DecoderConfig, spec) -> DecoderConfig:
    """`config` with its specs filled in as `layers` (`layer_specs`), every layer's feed-forward
    `spec` (an `ExpertsSpec`: a mixture of experts)."""
    return config.replace(layers=tuple(dataclasses.replace(s, ffn=spec) for s in layer_specs(config)))


# Gemma 4 at tests/families/shipped.py's tiny sizes, cut to a few layers (seconds to compile) for the decoding paths:
# the E2B's per-layer inputs with a sliding and a global layer that compute keys and values, then one of each that
# reads theirs; the 26B-A4B's experts beside each MLP, on a sliding layer and a global one. Its final cap (30)
# shrunk to where these tiny models' logits reach it (as tests/families/test_families.py's).
GEMMA4 = {"gemma-4-E2B-it": dict(num_hidden_layers=5, num_kv_shared_layers=2, final_logit_softcapping=3.0,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                              "sliding_attention", "full_attention"]),
          "gemma-4-26B-A4B-it": dict(num_hidden_layers=2, final_logit_softcapping=3.0,
                                     layer_types=["sliding_attention", "full_attention"])}


# The decoding paths that move, reorder, rewind or reuse a cache's rows (beams, sampled steps, speculative decoding,
# the prefix cache, perplexity's windows, the engine's slots) run on the E2B: its layers that read others' keys and
# values are what those paths could get wrong. The 26B-A4B's layers cache as a plain sliding and global layer do (its
# experts beside each MLP and its keys that are its values compute, tested against transformers in tests/families;
# rows of experts in the engine: test_engine's mixture of experts): it runs LoRA against peft.
GEMMA4_DECODING = ["gemma-4-E2B-it"]


@functools.cache
def tiny_gemma4(name: str):
    """`(Decoder, params)` of `GEMMA4[name]`: random weights (each model's seed and scale one whose greedy
    continuations vary rather than repeat a token), the embeddings at 0.4 / sqrt(d_model), as `shipped.scaled_up`
    draws Gemma's (Gemma multiplies them by sqrt(d_model): larger, each token's own embedding decides its next)."""
    from jaxformer.convert import config_from_hf
    from tests.families.shipped import tiny

    config = config_from_hf(tiny(name, **GEMMA4[name]), max_seq_len=64)
    seed, scale = {"gemma-4-E2B-it": (1, 0.6), "gemma-4-26B-A4B-it": (2, 0.4)}[name]
    params = random_params(config, seed=seed, scale=scale)
    return Decoder(config), {**params, "embed": params["embed"] * (0.4 / config.d_model ** 0.5) / scale}


def without_modules(names: tuple[str, ...]):
    """A context in which each flax module named in `names` (e.g. a latent attention's norms, `q_a_norm` and
    `kv_a_norm`) returns its input unchanged: the model as if it had no such module, for a guard that the
    module counts. A program must be traced inside it: `jit_apply`'s, traced before for the model with its
    modules, would be served again (`jit_apply_anew`)."""
    import flax.linen as nn

    def skipped(call, args, kwargs, context):
        if context.module.name in names and context.method_name == "__call__":
            return args[0]
        return call(*args, **kwargs)

    return nn.intercept_methods(skipped)


def jit_apply_anew(model, variables, *args):
    """`jit_apply(model, variables, *args)` from a program traced at this call: inside a context that changes
    how the model computes (`without_modules`), where `jit_apply`'s program of before would be served again."""
    return jax.jit(lambda variables, *args: model.apply(variables, *args))(variables, *args)


def scaled_random_params(params, seed: int, scale: float = 0.3):
    """Every leaf redrawn at a large scale, so attention is sharp and a wrong head
    grouping, RoPE pairing or projection layout changes the logits a lot.
    Norm weights are drawn around 1 so they still matter but do not vanish."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [1.0 + 0.5 * jax.random.normal(k, x.shape) if x.ndim == 1 else scale * jax.random.normal(k, x.shape)
           for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, new)


def run_main(main: Callable[[list[str]], int | None], argv: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    """A command line run in this process, as `sys.exit(main(argv))` runs it: its exit
    status, stdout and stderr, as `subprocess.run(..., capture_output=True, text=True)`
    gives them.

    Why: a fresh process costs Python's start, JAX's import and every compile again (the
    disk cache only saves XLA's part); in this process the programs an earlier test or
    run compiled are reused. Keep a real process where the process itself is under test:
    signals, a lock held by another process, a closed stdout, the interpreter's exit.

    What the command writes is caught where a subprocess's pipes would catch it: at file
    descriptors 1 and 2, so that C++ (absl, tensorstore, XLA) writing to them directly, and
    a logging handler made earlier around the old `sys.stderr`, are in it too.

    Args:
      main: the command's `main(argv)`, e.g. `train.reverse.main`.
      argv: its arguments.
      stdin: what it reads from standard input.

    Returns:
      `CompletedProcess(argv, returncode, stdout, stderr)`; the return code is the one
      `SystemExit` would give the process (None 0, a message 1, printed to stderr).
    """
    with _descriptor_captured(1, "stdout") as out, _descriptor_captured(2, "stderr") as err, \
            _stdin_from(io.StringIO(stdin)):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
        if status is not None and not isinstance(status, int):  # sys.exit("message")
            print(status, file=sys.stderr)
            status = 1
    return subprocess.CompletedProcess(argv, status or 0, out.getvalue(), err.getvalue())


class _Captured:
    """What a descriptor received, once the capture has ended (`getvalue()`)."""

    def __init__(self):
        self.text = ""

    def getvalue(self) -> str:
        return self.text


@contextlib.contextmanager
def _descriptor_captured(fd: int, name: str):
    """Descriptor `fd` and `sys.<name>` (and the logging handlers writing to the old
    `sys.<name>`) pointed at one temporary file for the block, everything put back after
    (as pytest's own capture does, so it is safe in an xdist worker).

    Yields:
      A `_Captured` holding the text written, once the block has ended.
    """
    old_stream = getattr(sys, name)
    if old_stream is not None:
        old_stream.flush()
    captured, saved_fd = _Captured(), os.dup(fd)
    # The stream writes to descriptor `fd`, whatever that points at; it is left open, so that
    # anything made during the block that kept it (a logging handler) writes where fd points.
    stream = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), fd)
        handlers = [h for h in _stream_handlers() if h.stream is old_stream]
        setattr(sys, name, stream)
        for handler in handlers:
            handler.setStream(stream)
        try:
            yield captured
        finally:
            stream.flush()
            for handler in handlers:
                handler.setStream(old_stream)
            setattr(sys, name, old_stream)
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
            file.seek(0)
            captured.text = file.read().decode("utf-8", errors="replace")


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every `logging.StreamHandler` of every logger (the root one too) whose stream is its own:
    not a file's, nor one whose `stream` is a property that reads `sys.stderr` each time
    (logging's last-resort kind, which dill's logger holds: it follows the capture by itself)."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger))]
    return [h for logger in loggers for h in logger.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and not isinstance(getattr(type(h), "stream", None), property)]


@contextlib.contextmanager
def _stdin_from(stream):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one entry per XLA compilation inside the block.

    (JAX times the backend compile around its persistent-cache lookup, so a program the
    cache above supplies counts as a compilation too.)"""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def optimized_programs():
    """LLVM's optimisation of the generated code on for this test's compiles: for a parity
    test against a peer, whose numbers the machine code could change in the last bits.
    The flag is not part of jax's in-memory jit cache key, so a program this worker
    compiled earlier is reused as it was."""
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", _NO_OPTIMISATIONS)


@pytest.fixture(scope="session")
def small():
    """(config, model, params) at the reference init."""
    return SMALL, Decoder(SMALL), init_params(SMALL)


def numpy_attention(q, k, v, mask, sinks=None, *, scale=None, softcap=None) -> tuple[np.ndarray, np.ndarray]:
    """Attention written out in float64 numpy, one query head at a time, its kv head picked by
    index: `(out [batch, T, n_head, head_dim], weights [batch, n_head, T, S])` of `q [batch, T,
    n_head, head_dim]`, `k, v [batch, S, n_kv, head_dim]` and a bool `mask [batch, T, S]`.

    Each row's softmax has one more column, the head's sink (`sinks [n_head]`; none: -inf), dropped
    after it: `softmax(concat(scores, sink))[..., :-1] @ v`. A row that sees no key gets weights 0
    (out 0), sink or not."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, T, n_head, head_dim = q.shape
    n_rep = n_head // k.shape[2]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    outs, weights = [], []
    for j in range(n_head):
        s = np.einsum("btd,bsd->bts", q[:, :, j], k[:, :, j // n_rep]) * scale  # [batch, T, S]
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        sink = -np.inf if sinks is None else float(sinks[j])
        s = np.concatenate([np.where(mask, s, -np.inf), np.full((batch, T, 1), sink)], -1)  # the sink: a last key
        top = s.max(-1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(top), top, 0))  # (a row of -inf alone: all 0)
        total = e.sum(-1, keepdims=True)
        w = (e / np.where(total > 0, total, 1))[..., :-1]  # the sink's column dropped
        weights.append(w)
        outs.append(w @ v[:, :, j // n_rep])  # [batch, T, head_dim]
    return np.stack(outs, 2), np.stack(weights, 1)


def numpy_decoder_logits(params, tokens, config: DecoderConfig, attention: list | None = None,
                         score_sizes: list | None = None) -> np.ndarray:
    """An independent float64 forward of the decoder, written the slow, obvious way:
    RoPE as multiplication by complex exponentials (none in a NoPE layer), attention one query
    head at a time with its kv head picked by index, a causal mask of -inf, each layer's norms
    where its spec places them (`LayerSpec.norms`). A list passed as `attention`
    receives each layer's weights `[B, n_head, T, T]`; one passed as `score_sizes` each
    layer's `[B, n_head, T]`: the largest `sum_d |q_d k_d| / sqrt(D)` of a query's visible
    scores (the magnitudes a float32 score sums, which its rounding scales with)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    d, H, K, D = config.d_model, config.n_head, config.n_kv_head, config.head_dim

    def rms(x, w):
        return x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + config.norm_eps) * w

    angles = np.arange(T)[:, None] * config.rope_theta ** (-np.arange(0, D, 2) / D)  # [T, D/2]
    rotation = np.exp(1j * angles)[None, :, None, :]

    def rope(x):  # [B, T, heads, D]
        if config.rope_pairing == "split_half":
            z = (x[..., :D // 2] + 1j * x[..., D // 2:]) * rotation
            return np.concatenate([z.real, z.imag], -1)
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rotation
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    def placed(norms: str, where: str, b: dict, name: str, h):
        # `h` through layer b's norm `name` where its placement puts one: "pre" and "sandwich" before a
        # sublayer, "sandwich" and "post" after it
        return rms(h, b[name]["weight"]) if norms in {"before": ("pre", "sandwich"), "after": ("sandwich", "post")}[
            where] else h

    causal = np.tril(np.ones((T, T), bool))
    x = p["embed"][tokens]
    for i, spec in enumerate(layer_specs(config)):
        b = p[f"block_{i}"]
        turn = rope if spec.mixer.use_rope else (lambda x: x)
        h = placed(spec.norms, "before", b, "attn_norm", x)
        bias = {name: b["attn"][name].reshape(-1) if config.qkv_bias else 0.0 for name in ("bq", "bk", "bv")}
        q = turn((h @ b["attn"]["wq"].reshape(d, H * D) + bias["bq"]).reshape(B, T, H, D))
        k = turn((h @ b["attn"]["wk"].reshape(d, K * D) + bias["bk"]).reshape(B, T, K, D))
        v = (h @ b["attn"]["wv"].reshape(d, K * D) + bias["bv"]).reshape(B, T, K, D)
        heads, weights, sizes = [], [], []
        for j in range(H):
            kv = j // (H // K)
            sizes.append(np.where(causal, np.einsum("btd,bsd->bts", np.abs(q[:, :, j]), np.abs(k[:, :, kv])), 0)
                         .max(-1) / np.sqrt(D))
            s = np.einsum("btd,bsd->bts", q[:, :, j], k[:, :, kv]) / np.sqrt(D)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            weights.append(w / w.sum(-1, keepdims=True))
            heads.append(weights[-1] @ v[:, :, kv])
        if attention is not None:
            attention.append(np.stack(weights, 1))
        if score_sizes is not None:
            score_sizes.append(np.stack(sizes, 1))
        x = x + placed(spec.norms, "after", b, "attn_post_norm",
                       np.concatenate(heads, -1) @ b["attn"]["wo"].reshape(H * D, d))
        h = placed(spec.norms, "before", b, "mlp_norm", x)
        gate = h @ b["mlp"]["w_gate"]
        x = x + placed(spec.norms, "after", b, "mlp_post_norm",
                       (gate / (1 + np.exp(-gate)) * (h @ b["mlp"]["w_up"])) @ b["mlp"]["w_down"])
    x = rms(x, p["final_norm"]["weight"])
    return x @ (p["embed"].T if config.tie_embeddings else p["lm_head"])


# The error model of two float32 programs that compute the same sums in other orders (programs
# of other shapes: other kernels, other fusions, a GPU's GEMMs picked per shape): a float32 sum's
# rounding is within n * eps32 * sum |terms| whatever the order of its n terms, and one order's
# rounding is of the size of another's. Each program's error is taken as within REORDERED times
# the error measured for one of them against the same program in float64 (whose own rounding is
# 2^29 times smaller), on the backend that runs them, so the two differ by at most
# 2 * REORDERED times that measurement.
REORDERED = 4


def in_float64(fn, *args):
    """`fn(*args)` under x64 with every float array of `args` (parameters, caches) in float64: the
    float64 twin of a float32 program, `fn` building its model with `float64_config`. (Jitted: one
    compile, where run eagerly each of its operations compiles on its own.)"""
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
                            else a, args)
        return jax.tree.map(np.asarray, jax.jit(fn)(*wide))


def float64_config(config: DecoderConfig) -> DecoderConfig:
    return config.replace(dtype=jnp.float64, param_dtype=jnp.float64)


def assert_reordered_equal(got, want, want64) -> None:
    """`got` and `want` (pytrees of two float32 programs' results that sum alike in other orders)
    are equal bitwise on a CPU, where XLA sums those shapes in one order, and elsewhere within
    `2 * REORDERED * max |want - want64|` per array, `want64` being `want`'s program in float64."""
    for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(want64), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if not np.issubdtype(w.dtype, np.floating):
            np.testing.assert_array_equal(g, w)
            continue
        bound = 2 * REORDERED * float(np.abs(w.astype(np.float64) - x).max())
        assert bound <= 1e-4 * max(float(np.abs(x).max()), 1.0), bound  # float32's rounding, not another result
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=bound)


def greedy_tokens_compared(got, want, logits, bound: float) -> int:
    """Asserts that greedy tokens `got` equal `want` (`[rows, new]`, the new tokens alone) wherever
    the choice is no near-tie, and returns how many tokens were compared.

    `logits` (`[rows, new, vocab]`) are the reference logits each token of `want` was picked
    from (as float as the caller has them), `bound` how far apart two float32 runs' logits may
    be: token t of a row is compared while the top two of its logits are more than `bound`
    apart (otherwise the other run may rightly pick the runner-up), and the row no further after
    its first near-tie: the tokens after it are continuations of the one picked there. The caller
    asserts that the count is large enough for the comparison to mean something."""
    got, want, logits = np.asarray(got), np.asarray(want), np.asarray(logits, np.float64)
    assert got.shape == want.shape == logits.shape[:2], (got.shape, want.shape, logits.shape)
    top = np.sort(logits, axis=-1)[..., -2:]
    clear = top[..., 1] - top[..., 0] > bound  # [rows, new]
    compared = 0
    for row in range(want.shape[0]):
        for t in range(want.shape[1]):
            if not clear[row, t]:
                break
            assert got[row, t] == want[row, t], \
                f"row {row}, new token {t}: {got[row, t]} against {want[row, t]}, whose logit leads by " \
                f"{top[row, t, 1] - top[row, t, 0]:.3g} > {bound:.3g}; got {got[row].tolist()}, " \
                f"want {want[row].tolist()}"
            compared += 1
    return compared


@functools.partial(jax.jit, static_argnums=0, static_argnames=("method", "mutable", "deterministic", "hidden"))
def jit_apply(model, variables, *args, **kwargs):
    """`model.apply(variables, *args, **kwargs)`, jitted: a reference computation for any
    test file. Why: run eagerly, each of its operations is compiled on its own; this one
    function object compiles once per model, method and shapes, for the whole process.
    (`mutable` as a string or a tuple: a static argument is hashed.)"""
    return model.apply(variables, *args, **kwargs)


def torch_peer():
    """`import_peer("torch")`, set to compute on one thread. The parity tests' models are tiny: on
    the threads torch starts by default (one per core) each matmul of a few kilobytes is split
    among threads that wait for each other while XLA's threads and the other pytest-xdist
    workers hold the cores, and a transformers forward takes 10-20x as long as on one thread
    (measured on 2 cores: 40 greedy steps of a tiny Gemma 2, 2.7 s against 0.16 s). The setting
    is the process's: torch keeps to one thread from then on."""
    torch = import_peer("torch")
    torch.set_num_threads(1)
    return torch
# DPO's command (tests/commands/test_finetune_dpo.py): the fast tier keeps a LoRA run (ln 2 at its first step, the
# held-out pairs ranked right, its report page) and the refusals; full fine-tuning's reference table and resume here.
FULL_TIER.update({
    "tests/commands/test_finetune_dpo.py::test_full_dpo_reads_the_reference_from_a_table_and_starts_at_ln_2":
        "a second DPO run",
    "tests/commands/test_finetune_dpo.py::test_a_resumed_dpo_run_gives_the_uninterrupted_runs_adapters_bit_for_bit":
        "three more DPO runs",
})
# GRPO's command (tests/commands/test_finetune_grpo.py): the fast tier keeps a LoRA run with the KL penalty and two
# updates a batch (what it logs, its report page), the engine's rollouts from a key and weights, and the refusals;
# the reward rising over 400 steps and resume here.
FULL_TIER.update({
    "tests/commands/test_finetune_grpo.py::test_the_reward_of_the_reversal_rises_over_a_few_hundred_steps":
        "400 GRPO steps",
    "tests/commands/test_finetune_grpo.py::test_a_resumed_run_repeats_the_uninterrupted_runs_rollouts_and_weights_bit_for_bit":
        "three more GRPO runs",
    "tests/commands/test_finetune_grpo.py::test_a_mixture_of_experts_with_a_capacity_samples_with_every_expert_and_trains":
        "a mixture's GRPO run",
})


def trl_dpo_trainer(output_dir, model, tokenizer, train: list[dict], *, eval_sets: dict[str, list[dict]] | None = None,
                    ref_model=None, peft_config=None, **config):
    """TRL's `DPOTrainer` of `model` (a transformers model) on the preference records `train`
    (and `eval_sets`, named lists of them), each tokenized by TRL as it prepares a dataset
    (`trainer.train_dataset`, `trainer.eval_dataset[name]`), in float32 on the CPU (TRL's `bf16`
    default off: it would run the reference under bfloat16 autocast), logging nowhere. `config`:
    more `DPOConfig` fields (`beta`, `max_length`)."""
    trl = import_peer("trl")
    import datasets

    args = trl.DPOConfig(output_dir=str(output_dir), report_to=[], bf16=False, use_cpu=True, disable_tqdm=True,
                         **config)
    evaluated = None if eval_sets is None else {name: datasets.Dataset.from_list(records)
                                                for name, records in eval_sets.items()}
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(train), eval_dataset=evaluated,
                          peft_config=peft_config)


def trl_dpo_metrics(trainer, dataset) -> tuple[float, dict[str, float]]:
    """TRL's DPO loss of the pairs of `dataset` (as `trl_dpo_trainer` prepared it) in one batch of
    its collator, its model in eval mode, and what it logs beside the loss (`jaxformer.dpo.METRICS`)."""
    from jaxformer.dpo import METRICS

    torch = torch_peer()
    batch = trainer.data_collator([{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
                                   for row in dataset])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    logged = trainer._metrics["eval"]  # each metric's list, this batch's last
    return float(loss), {name: logged[name][-1] for name in METRICS}
