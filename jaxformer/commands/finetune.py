"""`jaxformer-finetune --checkpoint DIR --data FILE`: adapt a Hugging Face checkpoint
to your text or chat data, with LoRA (the default) or all its parameters (--full).

  --data F.txt    any UTF-8 text: next-token loss on random windows of it (packed)
  --data F.jsonl  {"messages": [...]} records (rendered by the checkpoint's chat template,
                  loss on the assistant turns) or {"prompt", "completion"} records (loss on
                  the completion): one record a row, padded

--method dpo aligns it to preferences instead: direct preference optimisation on pairs,
{"prompt", "chosen", "rejected"} records as text or chat messages (TRL's format), the sigmoid
loss scaled by --beta against the checkpoint as read (with LoRA: its base, the adapters off).

--method grpo learns from rewards: {"prompt", ...} records, --num-generations completions of
each sampled by the serving engine with the policy's current weights, scored by --reward
(exact: the record's "answer"; regex: --reward-pattern; or module:function), and the clipped
objective of group relative policy optimisation (a KL penalty to the checkpoint with --beta).

The last 10 % of the data is held out: its loss (and perplexity; with DPO, the rewards and
their accuracy) is reported before and after training. A LoRA run writes its adapters to
RUN_DIR/adapter in peft's format (peft's PeftModel.from_pretrained and --adapter of
jaxformer-generate open it);
--merge DIR writes the fine-tuned model, adapters merged in, as a checkpoint folder.

AdamW (0.9, 0.999) with weight decay on matrices only, warm-up then cosine to 10 %, gradient
clipping, as one optax chain; with LoRA only the adapters are trained and held by it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer.command_line import (
    FAILED,
    add_quantize_flags,
    check_quantization,
    exit_process,
    fail,
    loading_memory,
    quantization,
    run_command,
)
from jaxformer.commands import dpo, grpo
from jaxformer.config import DTYPES, LORA_TARGETS, DecoderConfig, LoraConfig
from jaxformer.convert import load_hf, load_hf_config, save_hf
from jaxformer.convert.hf import TEXT_MODELS
from jaxformer.convert.peft import adapter_shapes_of, adapter_sizes, all_targets, check_targets, save_peft
from jaxformer.decodable import Decodable
from jaxformer.decoder import Decoder, attending_layers, expert_load, sown_attention_weights
from jaxformer.decoding import generate
from jaxformer.experts import ROUTER_COLLECTION, ExpertsSpec, dropped_pairs, load_balancing_loss, router_logits
from jaxformer.families import family_of
from jaxformer.files import read_json_object, write_folder_atomically
from jaxformer.layers import layer_specs
from jaxformer.lora import Adapted, init_lora, merge
from jaxformer.losses import chunk_positions, chunked_cross_entropy
from jaxformer.memory import cache_entry_bytes, check_fits, format_bytes
from jaxformer.rewards import load_reward
from jaxformer.runtime import is_primary
from jaxformer.schedules import warmup_cosine_schedule
from jaxformer.sharding import check_mesh_fits, make_mesh, param_axes, parse_mesh, to_host, tree_shardings
from jaxformer.text import load_tokenizer, save_tokenizer
from jaxformer.text.dataset import IGNORE, FinetuneData
from jaxformer.text.preference import PreferenceData
from jaxformer.text.prompts import PromptData
from jaxformer.text.tokenizer import check_fits_model
from jaxformer.training import exports, failures, flags, run_start, runs
from jaxformer.training.report_page import attention_group, experts_group, result_label, token_labels
from jaxformer.validation import NotFinite, as_float, as_int, one_of, refuse, require, why_not_finite

PROG = "jaxformer-finetune"
GRPO_FIELDS = ("num_generations", "max_completion_length", "temperature", "epsilon", "iterations", "reward",
               "reward_pattern")  # the settings GRPO alone reads
METHODS = ("sft", "dpo", "grpo")  # --method: the next-token loss; direct preference optimisation; GRPO
MODEL_CONFIG = DecoderConfig
ALL_TARGETS = "all"  # --lora-targets: every module LoRA can adapt (a model of experts' attention: not its experts)
ADAPTER_DIR = "adapter"  # in the run directory: the adapters in peft's format
MAP_TOKENS = 32  # of the first held-out row: the report page's attention example
SAMPLE_TOKENS = 32  # greedy tokens after the example's start, for the report page
LOAD_ROWS = 16  # held-out rows whose scored positions a mixture of experts routes for the page's expert load
# How the report page shows eval.json's results, in its order.
RESULT_LABELS = {"validation_loss_before": result_label("held-out loss before fine-tuning"),
                 "validation_perplexity_before": result_label("held-out perplexity before fine-tuning"),
                 "validation_loss": result_label("held-out loss after fine-tuning"),
                 "validation_perplexity": result_label("held-out perplexity after fine-tuning")}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The fine-tuning recipe; the defaults are the command line's.

    Attributes:
      checkpoint: the Hugging Face checkpoint folder (`jaxformer.convert.load_hf` reads it,
        `jaxformer.text.load_tokenizer` its tokenizer).
      data: the data file (`jaxformer.text.dataset.FinetuneData`: `.jsonl` records or text;
        with DPO `jaxformer.text.preference.PreferenceData`'s pairs).
      method: "sft" (the next-token loss on the data), "dpo" (`jaxformer.commands.dpo`) or
        "grpo" (`jaxformer.commands.grpo`).
      beta: DPO's reward scale (default `dpo.BETA`), GRPO's KL weight (default `grpo.BETA`); None
        for SFT, which has none.
      num_generations, max_completion_length, temperature, epsilon, iterations: GRPO's group
        size, the completions' most tokens (stop id included), their sampling temperature, the
        clip range, and the updates a batch of rollouts.
      reward, reward_pattern: GRPO's reward (`jaxformer.rewards.load_reward`'s spec and regex).
      full: train every parameter instead of LoRA adapters.
      lora_rank, lora_alpha, lora_dropout: the adapters' rank r, scale numerator (the
        change is `alpha / r * A @ B`) and the dropout rate on their input.
      lora_targets: "all", or peft's names of the adapted matrices, comma-separated.
      base_dtype: the frozen base's storage dtype under LoRA ("bfloat16" halves it); the
        adapters and optimizer state stay float32.
      steps, batch_size, lr, warmup, weight_decay, clip: the optimizer's recipe (with DPO a
        batch is `batch_size` pairs, twice as many rows).
      seq_len: tokens per row.
      seed: seeds the adapters, the batches and dropout.
      dtype: compute dtype.
      remat: recompute each block's activations in the backward pass instead of keeping them.
      capacity_factor: a mixture of experts' capacity (`ExpertsSpec.capacity_factor`): each
        expert takes at most `ceil(factor * tokens * k / E)` of a call's pairs, the rest dropped
        and counted; None (the default) drops none.
      quantize, quantize_group, quantize_affine, quantize_head: QLoRA: the frozen base's matrices (and,
        with quantize_head, its embedding and head) quantized as
        they are read (`jaxformer.command_line.quantization`; "int8", "int4" or "nf4"), under LoRA
        alone.

    Raises:
      ValueError: naming the flag of a value out of range.
    """

    checkpoint: str | None = None
    data: str | None = None
    method: str = "sft"
    beta: float | None = None
    num_generations: int = 4
    max_completion_length: int = 32
    temperature: float = 1.0
    epsilon: float = grpo.EPSILON
    iterations: int = 1
    reward: str | None = None
    reward_pattern: str | None = None
    full: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: str = ALL_TARGETS
    lora_dropout: float = 0.0
    base_dtype: str = "float32"
    steps: int = 200
    batch_size: int = 4
    lr: float = 2e-4
    warmup: int = 10
    weight_decay: float = 0.0
    clip: float = 1.0
    seq_len: int = 256
    seed: int = 0
    dtype: str = "float32"
    remat: bool = False
    capacity_factor: float | None = None
    quantize: str | None = None
    quantize_group: int | None = None
    quantize_affine: bool = False
    quantize_head: bool = False

    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("checkpoint", "data", "method", "beta", "full", "lora_rank",
                                                "lora_alpha", "lora_targets", "lora_dropout", "base_dtype", "steps",
                                                "batch_size", "lr", "warmup", "weight_decay", "clip", "seq_len", "seed",
                                                "capacity_factor", "quantize", "quantize_group", "quantize_affine",
                                                "num_generations", "max_completion_length", "temperature",
                                                "epsilon", "iterations", "reward", "reward_pattern",
                                                "quantize_head")
    INPUT_FIELDS: ClassVar[tuple[str, ...]] = ("checkpoint", "data")

    def __post_init__(self):
        flags.check_shared_settings(self)
        flags.check(self, as_int, "seq_len", "lora_rank", minimum=1)
        self._check_method()
        flags.check(self, as_int, "warmup", minimum=1, maximum=self.steps, maximum_name="--steps")
        flags.check(self, as_float, "lr", "clip", "lora_alpha", above=0)
        flags.check(self, as_float, "weight_decay", at_least=0)
        flags.check(self, as_float, "lora_dropout", at_least=0, below=1)
        flags.check(self, as_float, "capacity_factor", above=0, optional=True)
        require(self.base_dtype in DTYPES, "--base-dtype", f"one of {', '.join(DTYPES)}", self.base_dtype)
        require(not self.full or self.base_dtype == "float32", "--base-dtype",
                "float32 with --full, which trains (and so keeps in float32) every parameter", self.base_dtype)
        quantization(self)  # (a ValueError naming the flag)
        require(not self.full or self.quantize is None, "--quantize",
                "none with --full, which trains every parameter in float32 (QLoRA quantizes the frozen base of "
                "LoRA's adapters)", self.quantize)
        if self.lora_targets != ALL_TARGETS:
            try:
                lora = LoraConfig(targets=self.targets(None))
            except ValueError as e:
                raise ValueError(f"--lora-targets {self.lora_targets!r}, comma-separated or {ALL_TARGETS!r}: {e}") \
                    from None
            require(self.full or self.lora_dropout == 0 or not lora.parameter_targets, "--lora-dropout",
                    f"0 with the experts' targets ({', '.join(lora.parameter_targets)}): peft adapts a parameter "
                    "without dropout", self.lora_dropout)

    def _check_method(self) -> None:
        """The method's own settings checked (`--beta` given its default), and the other methods' left alone."""
        flags.check(self, one_of, "method", choices=METHODS)
        if self.beta is None and self.method != "sft":
            object.__setattr__(self, "beta", dpo.BETA if self.method == "dpo" else grpo.BETA)
        require(self.method != "sft" or self.beta is None, "--beta", "given only with --method dpo or grpo",
                self.beta)
        if self.method == "dpo":
            flags.check(self, as_float, "beta", above=0)
        if self.method == "grpo":
            flags.check(self, as_float, "beta", at_least=0)
            flags.check(self, as_int, "num_generations", minimum=2)  # an advantage compares a completion to others
            flags.check(self, as_int, "max_completion_length", minimum=1, maximum=self.seq_len - 1,
                        maximum_name="--seq-len - 1")
            flags.check(self, as_int, "iterations", minimum=1)
            flags.check(self, as_float, "epsilon", above=0)
            # Sampled: at 0 a group's completions would be one greedy answer, every advantage 0.
            flags.check(self, as_float, "temperature", above=0)
            require(self.reward is not None, "--reward", "given with --method grpo: exact, regex or module:function",
                    self.reward)
            return
        for field in dataclasses.fields(self):
            if field.name in GRPO_FIELDS:
                require(getattr(self, field.name) == field.default, flags.flag(field.name),
                        "given only with --method grpo", getattr(self, field.name))

    def targets(self, config: DecoderConfig | None) -> tuple[str, ...]:
        """`lora_targets` as peft's names: with "all", every module `config`'s format has (a model
        of experts: its attention's; its experts' matrices are named)."""
        if self.lora_targets == ALL_TARGETS:
            return all_targets(config)
        return tuple(t.strip() for t in self.lora_targets.split(","))

    def lora(self, config: DecoderConfig) -> LoraConfig | None:
        """The adapters' config for a checkpoint of `config`; None with `full`."""
        return None if self.full else LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha,
                                                  targets=self.targets(config), dropout=self.lora_dropout)

    @property
    def run_name(self) -> str:
        """A new run directory is runs/<run_name>-<time>: finetune-lora, dpo-full, ..."""
        return f"{'finetune' if self.method == 'sft' else self.method}-{'full' if self.full else 'lora'}"


def parse_args(argv=None) -> tuple[Settings, flags.RunOptions]:
    defaults = Settings()
    p = flags.make_parser(PROG, __doc__, defaults)
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="the Hugging Face checkpoint folder to adapt")
    p.add_argument("--data", metavar="FILE", required=True,
                   help="a .jsonl file of messages or prompt/completion records, or a UTF-8 text file")
    p.add_argument("--method", default=defaults.method, choices=METHODS,
                   help="sft: the next-token loss on the data; dpo: direct preference optimisation on "
                        "{prompt, chosen, rejected} pairs")
    p.add_argument("--beta", type=float, default=None,
                   help=f"DPO: the reward's scale, beta * (log pi - log pi_ref) (default {dpo.BETA}); GRPO: the "
                        f"weight of the KL penalty to the checkpoint (default {grpo.BETA}: none)")
    p.add_argument("--reward", metavar="SPEC", default=None,
                   help="GRPO: exact (the completion equals the record's answer), regex (it matches "
                        "--reward-pattern), or module:function, called as f(prompt, completion, **record) -> float")
    p.add_argument("--reward-pattern", metavar="REGEX", default=None, help="GRPO: --reward regex's pattern")
    p.add_argument("--num-generations", type=int, default=defaults.num_generations,
                   help="GRPO: completions sampled for each prompt (a group)")
    p.add_argument("--max-completion-length", type=int, default=defaults.max_completion_length,
                   help="GRPO: the most tokens of a completion (its stop token included)")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="GRPO: sampling temperature")
    p.add_argument("--epsilon", type=float, default=defaults.epsilon, help="GRPO: the ratio's clip range")
    p.add_argument("--iterations", type=int, default=defaults.iterations,
                   help="GRPO: optimizer updates on each batch of rollouts")
    p.add_argument("--full", action="store_true", help="train every parameter instead of LoRA adapters")
    p.add_argument("--lora-rank", type=int, default=defaults.lora_rank, help="the adapters' rank r")
    p.add_argument("--lora-alpha", type=float, default=defaults.lora_alpha,
                   help="the adapters' scale is alpha / r")
    p.add_argument("--lora-targets", default=defaults.lora_targets,
                   help=f"'{ALL_TARGETS}' (every module: a model of experts' attention, not its experts) or a "
                        f"comma-separated list of {', '.join(LORA_TARGETS)} (the last four: a layer of experts' "
                        "stacked matrices, peft's target_parameters, an adapter per expert; Gemma 4's are "
                        "experts.*, beside its MLP)")
    p.add_argument("--lora-dropout", type=float, default=defaults.lora_dropout,
                   help="dropout rate on the adapters' input, in training")
    p.add_argument("--base-dtype", default=defaults.base_dtype, choices=DTYPES,
                   help="storage dtype of the frozen base under LoRA (bfloat16 halves its memory)")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                   help="AdamW decay of the trained matrices")
    p.add_argument("--clip", type=float, default=defaults.clip, help="gradient clipping (global norm)")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per row")
    p.add_argument("--remat", action="store_true",
                   help="recompute each block's activations in the backward pass (less memory, more compute)")
    add_quantize_flags(p)  # QLoRA: the frozen base quantized
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="a mixture of experts: each expert takes at most factor * tokens * k / E of a step's "
                        "pairs (static shapes), the rest dropped and logged; default: none dropped")
    flags.add_run_flags(p, "finetune-<lora|full>", checkpoint_every=100, log_every=10)
    flags.add_export_flag(p, "--merge", help="after training, write the fine-tuned model (adapters merged in) and its "
                        "tokenizer as a checkpoint folder that transformers and jaxformer-generate open; with "
                        "--resume, a finished run is written without training")
    return flags.parse(p, argv, Settings)


def base_of(setup: runs.Setup) -> dict:
    """The checkpoint's parameters: LoRA's frozen base (`setup.frozen`), or with `--full` the
    start of training (`setup.params`)."""
    return setup.params if setup.model.config.lora is None else setup.frozen


def variables(setup: runs.Setup, trained) -> dict:
    """What the model applies with: the trained parameters, or with LoRA the base beside the
    adapters (never merged into a copy of the base, which would hold the weights twice)."""
    return {"params": trained} if setup.model.config.lora is None else {"params": setup.frozen, "lora": trained}


def decodable(setup: runs.Setup, trained) -> tuple[Decodable, dict]:
    """The model as decoding drives it, and its parameters: with LoRA, `Adapted`."""
    model = Decoder(setup.model.config.replace(remat=False))
    return (model, trained) if model.config.lora is None else (Adapted(model), {"base": setup.frozen, "lora": trained})


def build(settings: Settings = None, mesh: str | None = None, fsdp: bool = False) -> runs.Setup:
    """The checkpoint, its data and the recipe, ready to train.

    Args:
      settings: the recipe.
      mesh: `"data=N,model=M"` (`expert=E` too) to place the frozen base on (the trained parameters are placed
        by `jaxformer.training.placement.place`), or None for one device.
      fsdp: with `mesh`, split the base over `data` too.

    Raises:
      ValueError: an unreadable checkpoint or data file, a tokenizer whose ids the model
        lacks, `--seq-len` past the model's context, a LoRA rank past its matrices, a run
        whose parameters and optimizer state cannot fit the free memory, or a mesh that
        does not fit; each before a weight is read.
    """
    dtype, base_dtype = jnp.dtype(settings.dtype), jnp.dtype(settings.base_dtype)
    try:  # every flag checked against config.json before a weight is read
        config = load_hf_config(settings.checkpoint, dtype=dtype, param_dtype=base_dtype)
    except FileNotFoundError as e:
        raise ValueError(f"--checkpoint: {e}") from None
    require(settings.seq_len <= config.max_seq_len, "--seq-len", f"at most the model's context, {config.max_seq_len}",
            settings.seq_len)
    config = config.replace(lora=settings.lora(config), remat=settings.remat)
    # The training steps' model: with a capacity, its layers of experts drop what overflows (the model
    # evaluated and saved drops nothing).
    trained_model = Decoder(with_capacity(config, settings.capacity_factor))
    if config.lora is not None:
        try:
            check_targets(config, config.lora)  # now: the adapters are written after training
        except ValueError as e:
            raise ValueError(f"--lora-targets {settings.lora_targets}: {e}") from None
        check_rank(config, config.lora)
    how = quantization(settings)
    quantized_bytes = check_quantization(config, how)  # (a group that does not tile a matrix: refused here)
    # DPO: a pair is two rows; GRPO: a prompt is a group of completions.
    rows = settings.batch_size * {"sft": 1, "dpo": 2, "grpo": settings.num_generations}[settings.method]
    named = {"sft": None, "dpo": f"{rows} rows (--batch-size {settings.batch_size} pairs)",
             "grpo": f"{rows} rows (--batch-size {settings.batch_size} x --num-generations "
                     f"{settings.num_generations})"}[settings.method]
    check_memory(config, rows, settings.seq_len, quantized_bytes, *_grpo_bytes(config, settings), rows_named=named)
    if mesh is not None:
        mesh = make_mesh(**parse_mesh(mesh))
        check_mesh_fits(config, mesh)
    tokenizer = load_tokenizer(settings.checkpoint)
    check_fits_model(tokenizer, config.vocab_size, f"--checkpoint {settings.checkpoint}")
    if settings.method == "grpo":
        reward = load_reward(settings.reward, settings.reward_pattern)  # (a ValueError naming --reward)
        data = PromptData(settings.data, tokenizer, settings.seq_len - settings.max_completion_length,
                          "--seq-len - --max-completion-length")
    else:
        data = (PreferenceData if settings.method == "dpo" else FinetuneData)(settings.data, tokenizer,
                                                                               settings.seq_len)
    model = Decoder(config)
    shardings = None
    if mesh is not None:  # the base is read by every step: each tensor placed as the model's rules split it, as read
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *model.init_inputs()))["params"]
        shardings = tree_shardings(shapes, param_axes(model), mesh, "fsdp" if fsdp else "dp")
    try:
        with loading_memory():
            _, base = load_hf(settings.checkpoint, dtype=dtype, param_dtype=base_dtype, shardings=shardings,
                              quantize=how)
    except FileNotFoundError as e:
        raise ValueError(f"--checkpoint: {e}") from None
    lora = config.lora
    if lora is None:
        trained, axes = base, None
    else:
        trained = init_lora(base, lora, jax.random.key(settings.seed))
        axes = jax.tree.map(lambda x: (None,) * x.ndim, trained)  # small: a whole copy on every device
    schedule = warmup_cosine_schedule(settings.lr, settings.warmup, settings.steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(settings.clip),
        optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=settings.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )

    if settings.method == "dpo":
        objective, table = dpo.objective(trained_model, model, base, data, settings.beta, settings.batch_size)
        return runs.Setup(model=model, params=trained, optimizer=optimizer, schedule=schedule,
                          loss_fn=objective.loss_fn,
                          make_batch=functools.partial(data.batch, batch_size=settings.batch_size),
                          tokens_per_step=2 * settings.batch_size * settings.seq_len, corpus=data,
                          tokenizer=tokenizer, param_axes=axes, frozen=base if lora is not None else table,
                          objective=objective)

    if settings.method == "grpo":
        recipe = grpo.Recipe(group=settings.num_generations, max_new=settings.max_completion_length,
                             temperature=settings.temperature, epsilon=settings.epsilon, beta=settings.beta,
                             iterations=settings.iterations)
        # The reference, with a KL penalty: LoRA's base; with every parameter trained, a frozen copy.
        reference = None if settings.beta == 0 else base if lora is not None else jax.tree.map(jnp.copy, base)
        objective = grpo.Objective(trained_model, config, base if lora is not None else None, reference, data,
                                   tokenizer, reward, recipe, settings.batch_size, settings.seq_len, trained)
        return runs.Setup(model=model, params=trained, optimizer=optimizer, schedule=schedule,
                          loss_fn=objective.loss_fn, make_batch=functools.partial(_prompts, data, settings.batch_size),
                          tokens_per_step=settings.batch_size * settings.num_generations * settings.seq_len,
                          corpus=data, tokenizer=tokenizer, param_axes=axes, frozen=objective.frozen(),
                          objective=objective, make_step=objective.make_step)

    experts = [spec.ffn for spec in layer_specs(config) if isinstance(spec.ffn, ExpertsSpec)]

    def loss_fn(trained, batch, dropout_key, base=None):
        # The base (LoRA's frozen weights, an argument of the step: `runs.Setup.frozen`) is
        # read, never differentiated: only the adapters get gradients.
        variables = {"params": trained} if lora is None else {"params": base, "lora": trained}
        # The loss from the final hidden states, a chunk's logits at a time; the head is the base's (LoRA leaves it).
        (hidden, _), sown = trained_model.apply(variables, batch["tokens"], rngs={"dropout": dropout_key},
                                                hidden=True, mutable=[ROUTER_COLLECTION])
        head = model.output_head(variables["params"])
        loss = chunked_cross_entropy(hidden, batch["targets"], head, 0.0, ignore_id=IGNORE)
        if not experts:
            return loss, {}
        # A mixture of experts: plus its routers' load-balancing loss, weighted as its config.json says.
        balance = load_balancing_loss(router_logits(sown), experts[0].top_k)
        metrics = {"load_balancing_loss": balance}
        if settings.capacity_factor is not None:  # what the capacity dropped, every layer's pairs together
            metrics["dropped_pairs"] = dropped_pairs(sown)
        return loss + experts[0].aux_loss_coef * balance, metrics

    return runs.Setup(model=model, params=trained, optimizer=optimizer, schedule=schedule, loss_fn=loss_fn,
                      make_batch=functools.partial(data.batch, batch_size=settings.batch_size),
                      tokens_per_step=settings.batch_size * settings.seq_len, corpus=data, tokenizer=tokenizer,
                      param_axes=axes, frozen=None if lora is None else base)


def _prompts(data: PromptData, batch_size: int, data_key: jax.Array) -> dict[str, jax.Array]:
    """GRPO's batch of an update: its prompts' indices, and for each the key (its data, uint32) its
    group of completions is sampled from (rows first, as a mesh splits a batch)."""
    return {"prompt": data.batch(data_key, batch_size),
            "sample": jax.random.key_data(jax.random.split(jax.random.fold_in(data_key, 1), batch_size))}


def with_capacity(config: DecoderConfig, factor: float | None) -> DecoderConfig:
    """`config` whose layers of experts take `factor` as their capacity (`ExpertsSpec.capacity_factor`);
    `config` itself for None. Refuses a factor for a model without experts."""
    if factor is None:
        return config
    specs = layer_specs(config)
    require(any(isinstance(spec.ffn, ExpertsSpec) for spec in specs), "--capacity-factor",
            "given only for a checkpoint whose layers are experts", factor)
    return config.replace(layers=tuple(
        dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, capacity_factor=factor))
        if isinstance(spec.ffn, ExpertsSpec) else spec for spec in specs))


def check_rank(config: DecoderConfig, lora: LoraConfig) -> None:
    """Refuses a rank past the narrow side of the narrowest adapted matrix: the change `a^T b`
    of an `[n_in, n_out]` matrix has rank at most `min(n_in, n_out)`, so a larger rank adds
    parameters (and their memory, named in the message) but no freedom."""
    sizes = adapter_sizes(config, lora)
    adapter, (n_in, n_out) = min(((key[2], size) for key, size in sizes.items()), key=lambda item: min(item[1]))
    if lora.rank > min(n_in, n_out):
        target = next(t for t, a in zip(lora.targets, lora.adapters) if a == adapter)
        shapes = adapter_shapes_of(config, lora).values()
        adapters = 4 * sum(math.prod(a) + math.prod(b) for a, b in shapes)  # float32 a and b
        refuse("--lora-rank", f"at most {min(n_in, n_out)}, the narrow side of {target} ({n_in} in, {n_out} out): "
               f"A B has rank at most that, so a larger rank adds parameters ({format_bytes(adapters)} of adapters "
               "at this rank, 4x that with their gradients and Adam's moments) but no freedom", lora.rank)


def _grpo_bytes(config: DecoderConfig, settings: Settings) -> tuple[int, str]:
    """What GRPO holds beyond a step's own, and its words for `check_memory`: the serving
    engine's cache (a row for each completion of a step, `--seq-len` positions) and, with every
    parameter trained and a KL penalty, the reference's frozen copy of the weights."""
    if settings.method != "grpo":
        return 0, ""
    itemsize = jnp.dtype(config.cache_storage_dtype).itemsize
    cache = settings.batch_size * settings.num_generations * sum(
        cache_entry_bytes(entry, settings.seq_len, itemsize) for entry in config.cache_entries)
    copy = 0 if config.lora is not None or settings.beta == 0 else sum(
        math.prod(t.shape) for t in family_of(config).tensors(config)) * jnp.dtype(config.param_dtype).itemsize
    return cache + copy, (f"{format_bytes(cache)} of the sampler's cache"
                          + (f" and {format_bytes(copy)} of the reference's copy of the weights" if copy else ""))


def check_memory(config: DecoderConfig, batch_size: int, seq_len: int, quantized_bytes: int | None = None,
                 extra: int = 0, extra_note: str = "", rows_named: str | None = None) -> None:
    """Refuses, before anything is allocated, a run that cannot fit the free memory, by a
    lower bound of what a step holds: LoRA's frozen base (`quantized_bytes` where QLoRA quantizes
    it); the trained parameters (the
    adapters, or with `--full` the whole model) in float32 with their gradients and Adam's
    two moments; and of the activations, each block's input (which the backward pass reads,
    `--remat` or not), `[batch, seq_len, n_layer * d_model]` in the compute dtype, and the
    loss's one chunk of float32 logits (`chunked_cross_entropy` never holds them whole); and
    `extra` bytes a method holds besides (`extra_note` says what). `rows_named`: how the message
    names the `batch_size` rows where they are not `--batch-size`'s (DPO's pairs, GRPO's groups)."""
    base = sum(math.prod(t.shape) for t in family_of(config).tensors(config))
    trained = base if config.lora is None else sum(
        math.prod(a) + math.prod(b) for a, b in adapter_shapes_of(config, config.lora).values())
    state = 4 * 4 * trained  # parameters, gradients, Adam's mu and nu, each float32
    frozen = 0 if config.lora is None else quantized_bytes or base * jnp.dtype(config.param_dtype).itemsize
    positions = batch_size * seq_len
    activations = (positions * config.n_layer * config.d_model * jnp.dtype(config.dtype).itemsize
                   + min(positions, chunk_positions(config.vocab_size)) * config.vocab_size * 4)
    held = "quantized matrices" if quantized_bytes else jnp.dtype(config.param_dtype).name
    check_fits(state + frozen + activations + extra,
               f"fine-tuning with these flags ({format_bytes(frozen)} of frozen base in {held}, "
               f"{format_bytes(state)} of trained parameters with their gradients and Adam's moments, "
               + (f"{extra_note}, " if extra else "") + f"and at least {format_bytes(activations)} of activations "
               f"for {rows_named or f'--batch-size {batch_size}'} x --seq-len {seq_len})")


def validation_loss(setup: runs.Setup, trained, batch_size: int) -> float:
    """The mean loss over every scored token of the held-out split (one compiled program).
    With LoRA the adapters are applied beside the base, as in training: a merged copy of the
    base would hold the weights twice."""
    totals = np.array([jax.device_get(_held_out_sums(setup.model, variables(setup, trained), b))
                       for b in setup.corpus.validation_batches(batch_size)], np.float64)  # [batches, 2]
    return float(totals[:, 0].sum() / totals[:, 1].sum())


@functools.partial(jax.jit, static_argnums=0)
def _held_out_sums(model: Decoder, variables, batch) -> tuple[jax.Array, jax.Array]:
    """A batch's summed loss over its scored tokens, and their count: one program for the
    evaluation before training and the one after (the parameters an argument, not a constant)."""
    hidden, _ = model.apply(variables, batch["tokens"], hidden=True)
    scored = batch["targets"] != IGNORE
    mean = chunked_cross_entropy(hidden, batch["targets"], model.output_head(variables["params"]), 0.0,
                                 ignore_id=IGNORE)
    return mean * scored.sum(), scored.sum()


def held_out(setup: runs.Setup, trained, batch_size: int, when: str) -> tuple[float, float]:
    """`(loss, perplexity)` of the held-out split (`validation_loss`), both finite.

    Raises:
      NotFinite: saying `when` ("before training", ...) and why, when either is not finite:
        NaN or inf in the checkpoint's weights or the trained parameters (the first named),
        logits that overflowed, or a loss too large for its exponential.
    """
    loss = validation_loss(setup, trained, batch_size)
    if math.isfinite(loss) and loss < math.log(np.finfo(np.float64).max):
        return loss, math.exp(loss)
    cause = ("its exponential, the perplexity, overflows: the model gives the held-out tokens almost no probability"
             if math.isfinite(loss) else
             why_not_finite({"the checkpoint's weights": base_of(setup), "the trained parameters": trained},
                            setup.model.config.dtype))
    raise NotFinite(f"the held-out loss {when} is {loss:.6g}, not a result: {cause}")


def snapshotter(setup: runs.Setup, settings: Settings):
    """`snapshot(trained)` for the report page: the first and last layers' attention over the
    start of the first held-out row, and the greedy continuation of its first half; for a
    mixture of experts, each layer's expert load over the scored positions (those the loss
    scores) of the first `LOAD_ROWS` held-out rows."""
    data, tokenizer = setup.corpus, setup.tokenizer
    first = data.validation_batches(1)[0]["tokens"][0]  # [seq_len]
    length = min(MAP_TOKENS, settings.seq_len)
    example = first[None, :length]  # [1, T]
    labels = token_labels(tokenizer, example[0])
    config = setup.model.config
    attending = attending_layers(config)  # (a hybrid's linear layers weigh no keys: none to map)
    layers = sorted({attending[0], attending[-1]})
    prompt = jnp.asarray(example[:, :max(1, length // 2)])
    model = Decoder(config.replace(remat=False))

    @jax.jit  # one program, whatever the mesh: op by op, each operation on a split base would be one
    def attention_weights(variables, tokens):
        _, inter = model.apply(variables, tokens, mutable=["intermediates"])
        return sown_attention_weights(inter, config, layers)  # [len(layers), 1, H, T, T]

    experts = [spec.ffn for spec in layer_specs(config) if isinstance(spec.ffn, ExpertsSpec)]
    routed = data.validation_batches(LOAD_ROWS)[0]  # [LOAD_ROWS, seq_len] (rows past the split's score nothing)
    scored = routed["targets"] != IGNORE
    note = f"routed: the {int(scored.sum()):,} scored positions of the first {int(scored.any(1).sum())} held-out row(s)"
    loads = jax.jit(functools.partial(expert_load, model))

    def snapshot(trained) -> dict:
        weights = to_host(attention_weights(variables(setup, trained), example))
        attention = [attention_group("self-attention (causal)", layer, weights[k, 0], labels, labels)
                     for k, layer in enumerate(layers)]
        new = min(SAMPLE_TOKENS, config.max_seq_len - prompt.shape[1])
        out = to_host(generate(*decodable(setup, trained), prompt, max_new_tokens=new))[0]
        figures = {"attention": attention,
                   "samples": [{"label": "greedy continuation of a held-out row's start",
                                "input": token_labels(tokenizer, out[:prompt.shape[1]]),
                                "output": token_labels(tokenizer, out[prompt.shape[1]:])}]}
        if experts:
            counts = to_host(loads(variables(setup, trained), jnp.asarray(routed["tokens"]), jnp.asarray(scored)))
            figures["experts"] = [experts_group(layer, counts[layer], note) for layer in sorted(counts)]
        return figures

    return snapshot


def write_outputs(setup: runs.Setup, settings: Settings, trained: runs.Trained, run: flags.RunOptions) -> None:
    """The adapters into RUN_DIR/adapter (LoRA), and with `--merge` the fine-tuned
    checkpoint, each folder written whole or not at all."""
    config = setup.model.config
    if config.lora is not None:
        folder = run.run_dir / ADAPTER_DIR
        if is_primary():
            outer = read_json_object(os.path.join(settings.checkpoint, "config.json")).get("model_type")
            write_folder_atomically(folder, lambda tmp: save_peft(config, trained.params, config.lora, str(tmp),
                                                                  base_model=settings.checkpoint,
                                                                  image_text=outer in TEXT_MODELS))
        print(f"adapters (peft's format): {folder}: jaxformer-generate --checkpoint "
              f"{shlex.quote(settings.checkpoint)} --adapter {shlex.quote(str(folder))} --prompt ...")
    merge_dir = run.export
    if merge_dir is None:
        return
    tokenizer = setup.tokenizer
    # Merged where the base is (split over the mesh), then whole on every process (process 0 writes).
    params = to_host(trained.params if config.lora is None else merge(base_of(setup), trained.params, config.lora))

    def write(folder):
        save_hf(config.replace(lora=None, remat=False), params, str(folder), bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        save_tokenizer(tokenizer, str(folder))

    try:
        exports.write_export(merge_dir, write)
    except OSError as e:
        fail(PROG, f"cannot write --merge {merge_dir}: {e.strerror or e}; the trained run is kept in {run.run_dir}: "
                   f"write it with the same flags and --resume --run-dir {run.run_dir} --merge {merge_dir}", FAILED)
    print(f"fine-tuned checkpoint: {merge_dir}: jaxformer-generate --checkpoint "
          f"{shlex.quote(str(merge_dir))} --prompt ...")


def describe(setup: runs.Setup, settings: Settings) -> None:
    """The device, the checkpoint, what is trained, and the data."""
    config, data = setup.model.config, setup.corpus
    total, trained = run_start.count_params(base_of(setup)), run_start.count_params(setup.params)
    run_start.print_device()
    what = "every parameter" if config.lora is None else (
        f"LoRA r={config.lora.rank} alpha={config.lora.alpha:g} on {', '.join(config.lora.targets)}")
    print(f"checkpoint {settings.checkpoint} ({config.hf_model_type or 'llama'}): {config.n_layer} layers x "
          f"{config.d_model}, {total:,} params; training {what}: {trained:,} params ({trained / total:.2%})")
    if settings.method == "grpo":
        print(f"data {settings.data}: {len(data.train):,} prompts to train on, {len(data.val):,} held out; "
              f"{settings.num_generations} completions of each sampled a step, rewarded by {settings.reward}")
        return
    if settings.method == "dpo":
        print(f"data {settings.data}: {len(data.train['tokens']):,} pairs to train on, "
              f"{len(data.val['tokens']):,} held out"
              + (f" ({data.cut} cut to --seq-len {settings.seq_len})" if data.cut else "")
              + (f"; {data.dropped} left out, their prompt filling --seq-len" if data.dropped else ""))
        return
    rows = len(data.train["tokens"]) if data.kind == "records" else len(data.train)
    print(f"data {settings.data}: {rows:,} {'records' if data.kind == 'records' else 'tokens'} to train on"
          + (f" ({data.cut} cut to --seq-len {settings.seq_len})" if data.cut else ""))


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    settings, run = parse_args(argv)
    runs.start_process(PROG)
    setup = runs.build_or_fail(PROG, functools.partial(build, mesh=run.mesh, fsdp=run.fsdp), settings)
    with run_start.start(PROG, setup, settings, run) as begun:
        describe(setup, settings)
        if settings.method != "sft":
            return _align(setup, settings, run, begun)
        with failures.failing_as(begun):
            before, perplexity_before = held_out(setup, setup.params, settings.batch_size, "before training")
        print(f"held-out loss before: {before:.4f} (perplexity {perplexity_before:.3f})")
        trained = runs.train(setup, settings, run, begun, snapshotter(setup, settings))
        with failures.failing_as(begun):
            after, perplexity = held_out(setup, trained.params, settings.batch_size, "after training")
        print(f"held-out loss after:  {after:.4f} (perplexity {perplexity:.3f})")
        results = {"validation_loss_before": before, "validation_perplexity_before": perplexity_before,
                   "validation_loss": after, "validation_perplexity": perplexity}
        runs.write_results(run.run_dir, trained, results, RESULT_LABELS)
        with failures.failing_as(begun):
            write_outputs(setup, settings, trained, run)
    return 0


def _align(setup: runs.Setup, settings: Settings, run: flags.RunOptions, begun) -> int:
    """`_main`'s training and evaluation for DPO and GRPO: before and after training, the held-out
    pairs' loss and rewards (as TRL's `eval_` metrics), or the held-out prompts' reward."""
    objective = setup.objective
    if settings.method == "dpo":
        def held_out(trained):
            return objective.held_out(variables(setup, trained), settings.batch_size)

        snapshot, labels = snapshotter(setup, settings), dpo.RESULT_LABELS
    else:
        held_out, snapshot, labels = objective.held_out, objective.snapshot, grpo.RESULT_LABELS
    with failures.failing_as(begun):
        before = held_out(setup.params)
    print("held-out before: " + _metrics_line(before))
    trained = runs.train(setup, settings, run, begun, snapshot)
    with failures.failing_as(begun):
        after = held_out(trained.params)
    print("held-out after:  " + _metrics_line(after))
    results = {**{f"{name}_before": value for name, value in before.items()}, **after}
    runs.write_results(run.run_dir, trained, results, labels)
    with failures.failing_as(begun):
        write_outputs(setup, settings, trained, run)
    return 0


def _metrics_line(metrics: dict[str, float]) -> str:
    """`loss 0.6931, rewards/chosen 0.0000, ...` without the `eval_` prefix."""
    return ", ".join(f"{name.removeprefix('eval_')} {value:.4f}" for name, value in metrics.items())


if __name__ == "__main__":
    exit_process(main())
