"""`jaxformer-finetune --method dpo`: direct preference optimisation of a checkpoint on pairs
of answers (`jaxformer.dpo`: the sigmoid loss and what TRL logs; `jaxformer.text.preference`:
the pairs), its adapters or every parameter trained as `jaxformer-finetune` trains them.

The reference is the checkpoint as it was read. With LoRA it is the base the adapters sit on,
applied with the adapters off inside each step (as TRL does with peft): the weights are held
once. With every parameter trained, the reference's log-probabilities of every training pair
are computed once before training and passed to each step (a table of two floats a pair): no
frozen copy of the weights either. The held-out pairs' reference log-probabilities are
computed once, in the program and batches of their evaluation, so that before training the
held-out loss is exactly `ln 2`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decoder import Decoder
from jaxformer.dpo import METRICS, dpo_metrics, dpo_per_pair, sequence_logps
from jaxformer.text.preference import PreferenceData
from jaxformer.training.report_page import result_label

BETA = 0.1  # --beta's default, TRL's
# How the report page shows the held-out results, before and after training (eval.json's keys, TRL's eval_ names).
RESULT_LABELS = {f"eval_{name}{when}": result_label(f"held-out {name.replace('/', ' ')} {label}")
                 for when, label in (("_before", "before training"), ("", "after training"))
                 for name in ("loss", *METRICS)}


@dataclasses.dataclass(frozen=True)
class Objective:
    """DPO's loss for `jaxformer-finetune`'s step, and its held-out evaluation.

    Attributes:
      model: the policy as trained (`config.lora` set with LoRA; with `--capacity-factor`, its
        experts dropping what overflows).
      evaluated: the policy as evaluated: `model` dropping nothing.
      reference: the model that gives the reference's log-probabilities: the checkpoint's
        model without adapters, dropping nothing.
      beta: the reward's scale.
      lora: whether the trained parameters are adapters on a frozen base.
      data: the pairs.
      held_out_reference: each held-out batch's reference log-probabilities `[2 B]`.
    """

    model: Decoder
    evaluated: Decoder
    reference: Decoder
    beta: float
    lora: bool
    data: PreferenceData
    held_out_reference: tuple[np.ndarray, ...]

    def loss_fn(self, trained, batch, dropout_key, frozen):
        """`(loss, metrics)` of a batch of pairs; `frozen` is LoRA's base, or with every parameter
        trained `{"reference": [pairs, 2]}`, the training pairs' reference log-probabilities."""
        tokens, targets = batch["tokens"], batch["targets"]
        if self.lora:
            variables = {"params": frozen, "lora": trained}
            # The base alone, its adapters off: the reference, read and never differentiated.
            reference = jax.lax.stop_gradient(sequence_logps(self.reference, {"params": frozen}, tokens, targets))
        else:
            variables = {"params": trained}
            reference = frozen["reference"][batch["pair"]].T.reshape(-1)  # [B, 2] -> [2 B], the chosen first
        logps = sequence_logps(self.model, variables, tokens, targets, rngs={"dropout": dropout_key})  # [2 B]
        return dpo_metrics(logps, reference, self.beta)

    def held_out(self, variables: dict, batch_size: int) -> dict[str, float]:
        """The held-out pairs' loss and `METRICS`, means over every pair (each pair's values summed
        in float64: before training the loss is then exactly float32's `ln 2` however many pairs),
        under the policy of `variables` (`{"params": ...}`, with LoRA `"lora"` too)."""
        kept = []  # each batch's per-pair values, its filler pairs left out
        for batch, reference in zip(self.data.validation_batches(batch_size), self.held_out_reference):
            values = jax.device_get(_held_out_per_pair(self.evaluated, self.beta, variables, batch, reference))
            real = batch["pair"] >= 0
            kept.append({name: np.asarray(value, np.float64)[real] for name, value in values.items()})
        return {f"eval_{name}": float(np.concatenate([k[name] for k in kept]).mean()) for name in kept[0]}


def objective(model: Decoder, evaluated: Decoder, base, data: PreferenceData, beta: float,
              batch_size: int) -> tuple[Objective, dict | None]:
    """DPO's `Objective` for the policy `model` as trained and `evaluated`, and the checkpoint's
    parameters `base`, and what each step reads beside the trained parameters with every
    parameter trained (`{"reference": [pairs, 2]}`; None with LoRA, whose steps read the base)."""
    reference = Decoder(evaluated.config.replace(lora=None, remat=False))
    logps = functools.partial(_logps, reference, {"params": base})
    held_out = tuple(np.asarray(logps(batch)) for batch in data.validation_batches(batch_size))
    lora = model.config.lora is not None
    table = None
    if not lora:  # [pairs, 2]: each training pair's chosen, then rejected, reference log-probability
        chosen_first = [np.asarray(logps(batch)).reshape(2, -1).T for batch in data.training_batches(batch_size)]
        table = {"reference": jnp.asarray(np.concatenate(chosen_first)[:len(data.train["tokens"])])}
    return Objective(model=model, evaluated=evaluated, reference=reference, beta=beta, lora=lora, data=data,
                     held_out_reference=held_out), table


@functools.partial(jax.jit, static_argnums=0)
def _logps(model: Decoder, variables: dict, batch: dict) -> jax.Array:
    return sequence_logps(model, variables, batch["tokens"], batch["targets"])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _held_out_per_pair(model: Decoder, beta: float, variables: dict, batch: dict, reference: jax.Array):
    """A held-out batch's `dpo_per_pair` values."""
    return dpo_per_pair(sequence_logps(model, variables, batch["tokens"], batch["targets"]), reference, beta)
