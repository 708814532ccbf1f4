"""`jaxformer-finetune --method grpo`: reinforcement learning from verifiable rewards by group
relative policy optimisation (`jaxformer.grpo`: the advantages and the clipped objective;
`jaxformer.rewards`: the rewards; `jaxformer.text.prompts`: the prompts).

One training step is one batch of rollouts and what is learned from it:

  1. the serving engine (`jaxformer.serving.Engine`, continuous batching) takes the policy's
     weights of the moment (`Engine.set_params`: the trained parameters themselves, no copy),
     and samples `--num-generations` completions of each of the batch's prompts, every request
     queued at once (`Engine.submit_all`) with its key drawn from the step's: the same seed and
     weights sample the same completions;
  2. the reward scores each completion (prompt, completion text, the record's other fields),
     and each completion's advantage is its reward against its group's;
  3. with a KL penalty (`--beta` > 0), the reference's log-probabilities of the completions:
     with LoRA the base, adapters off; with every parameter trained a frozen copy of the
     checkpoint's weights (the one case that holds them twice); with more than one update a
     batch (`--iterations`), the sampling policy's;
  4. `--iterations` optimizer updates on the clipped objective (`jaxformer.grpo.grpo_loss`),
     each a jitted step of `jaxformer.training.make_train_step`.

What the step logs: the loss, the reward's mean and spread (`reward`, `reward_std`), `kl`,
`clip_ratio` and the mean completion length. The held-out prompts' reward (each answered
greedily) is measured before and after training.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decodable import Decodable
from jaxformer.decoder import Decoder
from jaxformer.decoding.request import DecodeOptions
from jaxformer.grpo import group_advantages, grpo_loss
from jaxformer.lora import Adapted
from jaxformer.losses import chunked_token_logps
from jaxformer.rewards import score
from jaxformer.serving.engine import Engine
from jaxformer.sharding import to_host
from jaxformer.text.dataset import IGNORE, Example, rows
from jaxformer.text.prompts import Prompt, PromptData
from jaxformer.text.tokenizer import Tokenizer
from jaxformer.training.report_page import result_label, token_labels
from jaxformer.training.state import make_train_step
from jaxformer.validation import NotFinite

BETA = 0.0  # --beta's default, TRL's: no KL penalty, no reference
EPSILON = 0.2  # --epsilon's default: the clip range of the ratio
SAMPLES = 2  # held-out prompts whose completions the report page shows at each checkpoint
RESULT_LABELS = {"eval_reward_before": result_label("held-out mean reward before training (greedy)"),
                 "eval_completion_length_before": result_label("held-out mean completion length before (tokens)"),
                 "eval_reward": result_label("held-out mean reward after training (greedy)"),
                 "eval_completion_length": result_label("held-out mean completion length after (tokens)")}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """GRPO's settings: `group` completions a prompt, at most `max_new` tokens each, sampled at
    `temperature`; the clip range `epsilon`, the KL weight `beta`, `iterations` updates a batch."""

    group: int
    max_new: int
    temperature: float
    epsilon: float
    beta: float
    iterations: int


class Objective:
    """GRPO's step for `jaxformer-finetune` and its held-out evaluation.

    Args:
      model: the policy as trained (`config.lora` set with LoRA; with `--capacity-factor`, its
        experts dropping what overflows).
      config: its config as read (dropping nothing): the sampler's and the reference's.
      base: LoRA's frozen base; None with every parameter trained.
      reference: the reference's parameters (with `recipe.beta` > 0: the base, or a frozen copy of
        the checkpoint's), or None.
      data: the prompts.
      tokenizer: the checkpoint's (completions decoded for the reward; its stop ids end them).
      reward: `reward(prompt, completion, **fields) -> float` (`jaxformer.rewards.load_reward`).
      recipe: the settings.
      batch_size: prompts a step.
      seq_len: the rows' width, prompt and completion.
      params: the trained parameters' initial values (the engine is built for their shapes).
    """

    def __init__(self, model: Decoder, config, base, reference, data: PromptData, tokenizer: Tokenizer,
                 reward: Callable, recipe: Recipe, batch_size: int, seq_len: int, params):
        self.model, self.base, self.reference, self.data = model, base, reference, data
        self.tokenizer, self.reward, self.recipe, self.seq_len = tokenizer, reward, recipe, seq_len
        self.lora = model.config.lora is not None
        self.reference_model = Decoder(config.replace(lora=None, remat=False))
        decoding = Decoder(config.replace(remat=False))
        self.decodable: Decodable = Adapted(decoding) if self.lora else decoding
        rows_ = batch_size * recipe.group
        self.engine = Engine(self.decodable, self._decoding_params(params), max_batch=rows_, capacity=seq_len,
                             max_queue=max(rows_, len(data.val)), stop_ids=tokenizer.stop_ids)

    def _decoding_params(self, trained):
        return {"base": self.base, "lora": trained} if self.lora else trained

    def frozen(self):
        """What each update reads beside the trained parameters: LoRA's base, or None."""
        return self.base

    # The objective of one update.

    def loss_fn(self, trained, batch, dropout_key, frozen=None):
        """`(loss, {kl, clip_ratio})` of a batch of rollouts (`rollouts`' rows)."""
        variables = {"params": frozen, "lora": trained} if self.lora else {"params": trained}
        logps = _token_logps(self.model, variables, batch["tokens"], batch["targets"], rngs={"dropout": dropout_key})
        old = jax.lax.stop_gradient(logps) if "old" not in batch else batch["old"]  # one update: the ratio is 1
        return grpo_loss(logps, old, batch.get("reference"), batch["advantages"], batch["targets"] != IGNORE,
                         epsilon=self.recipe.epsilon, beta=self.recipe.beta)

    def make_step(self, optimizer, state_sharding=None) -> Callable:
        """`step(state, batch, dropout_key) -> (state, metrics)`: a batch of prompts (`batch`:
        `prompt` indices and their `sample` keys) sampled, scored and learned from (the module
        docstring's four stages). The state is donated, as `make_train_step`'s."""
        update = make_train_step(self.loss_fn, optimizer, state_sharding, frozen=self.frozen())
        policy_logps = jax.jit(_token_logps, static_argnums=0)

        def step(state, batch, dropout_key):
            batch = to_host(batch)  # (whole on every process: each samples every completion)
            prompts = [self.data.train[int(i)] for i in batch["prompt"]]
            rollout, found = self.rollouts(state.params, prompts, jax.random.wrap_key_data(batch["sample"]))
            if self.recipe.beta > 0:
                rollout["reference"] = policy_logps(self.reference_model, {"params": self.reference},
                                                    rollout["tokens"], rollout["targets"])
            if self.recipe.iterations > 1:  # the sampling policy's, fixed while its updates move the policy
                variables = {"params": self.base, "lora": state.params} if self.lora else {"params": state.params}
                rollout["old"] = policy_logps(self.model, variables, rollout["tokens"], rollout["targets"])
            learned = []
            for i in range(self.recipe.iterations):
                state, metrics = update(state, rollout, jax.random.fold_in(dropout_key, i))
                learned.append(metrics)
            means = {name: jnp.mean(jnp.stack([m[name] for m in learned])) for name in learned[0]}
            return state, {**means, **found}

        return step

    # Rollouts.

    def sample(self, trained, prompts: list[Prompt], keys: list | None) -> list[list[int]]:
        """Each prompt's completion by the engine under `trained` (sampled with its key, or greedily
        with `keys` None): its ids, the stop id that ended it included."""
        self.engine.set_params(self._decoding_params(trained))
        options = [DecodeOptions(max_new_tokens=self.recipe.max_new, temperature=self.recipe.temperature, key=key)
                   for key in keys] if keys is not None else DecodeOptions(max_new_tokens=self.recipe.max_new)
        completions = []
        for handle in self.engine.submit_all([p.ids for p in prompts], options):
            tokens = []
            for event in handle.events():
                tokens += event.tokens
            if event.finish_reason == "error":  # (the engine's one error: logits that are not finite)
                raise NotFinite(f"sampling a completion failed: {event.error}")
            completions.append(tokens + ([event.stop_id] if event.stop_id is not None else []))
        return completions

    def rollouts(self, trained, prompts: list[Prompt], keys: jax.Array) -> tuple[dict, dict]:
        """`recipe.group` completions of each of `prompts` (completion j of prompt i sampled with
        `fold_in(keys[i], j)`), scored: the rows to learn from (`tokens`, `targets` `[N, seq_len]`,
        the completion scored; `advantages` `[N]`) and what the step logs of them."""
        group = [p for p in prompts for _ in range(self.recipe.group)]  # [N], each prompt's group together
        keys = [jax.random.fold_in(key, j) for key in keys for j in range(self.recipe.group)]
        completions = self.sample(trained, group, keys)
        rewards = np.asarray([self.score(p, ids) for p, ids in zip(group, completions)], np.float32)  # [N]
        examples = [Example(ids=p.ids + ids, scored=[False] * len(p.ids) + [True] * len(ids))
                    for p, ids in zip(group, completions)]
        batch = {name: jnp.asarray(x) for name, x in rows(examples, self.seq_len).items()}
        batch["advantages"] = group_advantages(jnp.asarray(rewards), self.recipe.group)
        lengths = np.asarray([len(ids) for ids in completions], np.float32)
        found = {"reward": rewards.mean(), "reward_std": rewards.std(ddof=1), "completion_length": lengths.mean()}
        return batch, {name: jnp.float32(value) for name, value in found.items()}

    def score(self, prompt: Prompt, ids: list[int]) -> float:
        """The reward of one completion, its text decoded without its stop id."""
        text = self.tokenizer.decode([i for i in ids if i not in self.engine.stop_ids])
        return score(self.reward, prompt.prompt, text, prompt.fields)

    def snapshot(self, trained) -> dict:
        """For the report page (`jaxformer.training.report_page.record_snapshot`): the first
        held-out prompts' greedy completions, each with its reward."""
        shown = self.data.val[:SAMPLES]
        completions = self.sample(trained, shown, None)
        return {"attention": [], "samples": [
            {"label": f"a held-out prompt's greedy completion, reward {self.score(p, ids):g}",
             "input": token_labels(self.tokenizer, p.ids), "output": token_labels(self.tokenizer, ids)}
            for p, ids in zip(shown, completions)]}

    def held_out(self, trained) -> dict[str, float]:
        """The held-out prompts' mean reward, each answered greedily, and the mean completion length."""
        completions = self.sample(trained, self.data.val, None)
        rewards = [self.score(p, ids) for p, ids in zip(self.data.val, completions)]
        return {"eval_reward": float(np.mean(rewards)),
                "eval_completion_length": float(np.mean([len(ids) for ids in completions]))}


def _token_logps(model: Decoder, variables: dict, tokens: jax.Array, targets: jax.Array, **apply) -> jax.Array:
    """`log p(target)` at each position, 0 where not scored: float32 `[N, T]`."""
    hidden, _ = model.apply(variables, tokens, hidden=True, **apply)
    return chunked_token_logps(hidden, targets, model.output_head(variables["params"]), ignore_id=IGNORE)
