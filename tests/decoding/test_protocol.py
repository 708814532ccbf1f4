"""The decoding loop needs a model's protocol, not its class: a third model decodes too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import KVCache, generate, stream
from jaxformer.decoding import DecodingSpec

VOCAB, MAX_LEN = 11, 16


class Bigram(nn.Module):
    """The next token's logits are a row of a table, picked by the current token."""

    @nn.compact
    def __call__(self, tokens):
        return self.param("table", nn.initializers.normal(1.0), (VOCAB, VOCAB))[tokens]  # [batch, T, vocab]

    @nn.nowrap
    def decoding_spec(self):
        return DecodingSpec(prompt_vocab_size=VOCAB, vocab_size=VOCAB, max_seq_len=MAX_LEN, pad_id=0,
                            ragged_prompts=True)

    @nn.nowrap
    def decoder_prompt(self, prompt, bos_id):
        return prompt

    @nn.nowrap
    def init_cache(self, batch_size, capacity, rewind=0):  # the loop only counts positions in it
        return KVCache.zeros(batch_size, capacity, n_layer=1, n_kv_head=1, head_dim=1, max_seq_len=MAX_LEN,
                             dtype=jnp.float32)

    def decode_context(self, prompt):
        return None

    def decode_step(self, tokens, cache, context):
        return self(tokens), cache.advance(tokens.shape[1])


def test_a_model_that_only_speaks_the_protocol_decodes():
    model = Bigram()
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    table = np.asarray(params["table"])
    prompt = np.array([[3, 4], [5, 6]])
    out = np.asarray(generate(model, params, prompt, max_new_tokens=6))
    want = [list(row) for row in prompt]
    for row in want:  # greedy by hand: the argmax of the last token's row, six times
        for _ in range(6):
            row.append(int(table[row[-1]].argmax()))
    np.testing.assert_array_equal(out, want)
    streamed = np.stack(list(stream(model, params, prompt, max_new_tokens=6)), axis=1)
    np.testing.assert_array_equal(streamed, out[:, 2:])
    beams = np.asarray(generate(model, params, prompt, max_new_tokens=6, num_beams=3))
    assert beams.shape == (2, 8)
