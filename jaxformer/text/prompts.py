"""Prompts for reinforcement learning from rewards: what the policy answers, and what its
reward function is told about each.

A `.jsonl` file holds one record a line, `{"prompt": str or [messages], ...}`: a text prompt is
tokenized as the tokenizer frames a text (a BOS first), a conversation rendered by the chat
template with the assistant's header after it. Every other key of the record (an `answer`, a
`pattern`) is handed to the reward with the prompt and each completion
(`jaxformer.rewards.score`). The last 10 % (at least one record) is held out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxformer.text.chat import render_chat
from jaxformer.text.dataset import HELD_OUT, checked_messages, json_kind, jsonl_records
from jaxformer.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One record: its prompt as given (text or messages), its ids, and its other fields."""

    prompt: str | list[dict]
    ids: list[int]
    fields: dict


def prompt_of(tokenizer: Tokenizer, record) -> Prompt:
    """The `Prompt` of one parsed record; a one-line `ValueError` saying what it holds instead."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError(f'a prompt record is {{"prompt": str or [{{"role", "content"}} messages], ...}} '
                         f"(got {json_kind(record) if not isinstance(record, dict) else 'no prompt'})")
    prompt, fields = record["prompt"], {k: v for k, v in record.items() if k != "prompt"}
    if "completion" in fields:
        raise ValueError("a prompt record's other keys reach the reward beside the completion it is given: "
                         "one named 'completion' would hide it")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        text = render_chat(tokenizer, checked_messages(prompt, "prompt"), add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)  # (the template writes its own BOS)
    if not ids:
        raise ValueError("the prompt is empty: it has no token to continue")
    return Prompt(prompt=prompt, ids=ids, fields=fields)


class PromptData:
    """A prompt file (module docstring: the format), split into training and held-out prompts.

    Args:
      path: a `.jsonl` file of prompt records.
      tokenizer: the checkpoint's tokenizer.
      max_prompt: the most ids a prompt may hold (the window less the completion's room).
      room: how `max_prompt` reads in a message (its flags).

    Raises:
      ValueError: naming the file (and line): unreadable, a malformed record, a prompt past
        `max_prompt`, or fewer than 2 records.
    """

    def __init__(self, path: str, tokenizer: Tokenizer, max_prompt: int, room: str):
        if not path.endswith(".jsonl"):
            raise ValueError(f"--data {path}: prompts are a .jsonl file of {{\"prompt\": ...}} records")
        prompts = jsonl_records(path, prompt_of, tokenizer)
        for line, prompt in prompts:
            if len(prompt.ids) > max_prompt:
                raise ValueError(f"{path}:{line}: the prompt is {len(prompt.ids)} tokens, past {room} = {max_prompt}")
        if len(prompts) < 2:
            raise ValueError(f"{path} holds {len(prompts)} record(s): at least 2 are needed (one to train, "
                             "one to validate)")
        n_val = max(1, int(round(HELD_OUT * len(prompts))))
        self.train = [p for _, p in prompts[:-n_val]]
        self.val = [p for _, p in prompts[-n_val:]]

    def batch(self, key: jax.Array, batch_size: int) -> jax.Array:
        """`batch_size` training prompts' indices drawn from `key`: int32 `[batch_size]`, without
        repeats while there are enough prompts."""
        return _draw(key, len(self.train), batch_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(key: jax.Array, n: int, batch_size: int) -> jax.Array:
    return jax.random.choice(key, n, (batch_size,), replace=batch_size > n).astype(jnp.int32)
