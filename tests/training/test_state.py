"""`jaxformer.training.state`: the train state, the jitted donated step, the step keys."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SMALL, count_compiles
from linear_regression import BATCH, IN, LR, init_state, loss_fn, make_batch

from jaxformer import Decoder, VanillaConfig, VanillaTransformer
from jaxformer.training import TrainState, make_train_step, make_train_steps, step_keys
from jaxformer.training.runs import init_params
from jaxformer.training.state import CompiledAhead, compiler_options


def test_train_step_lowers_loss_increments_step_and_compiles_once():
    optimizer = optax.adam(LR)
    train_step = make_train_step(loss_fn, optimizer)
    state = init_state(optimizer)
    # Batches and keys made up front: their eager ops compile too, and are not counted.
    inputs = [(make_batch(d), k) for d, k in (step_keys(0, s) for s in range(40))]
    half = jax.tree.map(lambda x: x[: BATCH // 2], inputs[0][0])

    state, first = train_step(state, *inputs[0])
    with count_compiles() as compiles:
        for batch, key in inputs[1:]:
            state, metrics = train_step(state, batch, key)
        jax.block_until_ready(state)
    assert compiles == []  # steps 2..40 reuse the first step's executable
    assert int(state.step) == 40
    assert set(metrics) == {"loss", "mae"}
    assert float(metrics["loss"]) < 0.25 * float(first["loss"])
    with count_compiles() as compiles:  # the counter does see compiles: a new batch shape is one
        train_step(state, half, inputs[0][1])
    assert len(compiles) == 1


def test_train_step_donates_the_state():
    optimizer = optax.adam(LR)
    train_step = make_train_step(loss_fn, optimizer)
    state = init_state(optimizer)
    data_key, dropout_key = step_keys(0, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new_state, _ = jax.block_until_ready(train_step(state, make_batch(data_key), dropout_key))
    old = jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)
    if any("donat" in str(w.message).lower() for w in caught):
        # The backend said it cannot donate: the old buffers must then still be intact.
        assert not any(x.is_deleted() for x in old)
    else:
        assert all(x.is_deleted() for x in old)
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_state))


def test_a_program_compiled_ahead_compiles_once_and_computes_what_the_jitted_one_does():
    optimizer = optax.adam(LR)
    steps = make_train_steps(loss_fn, optimizer, make_batch, seed=0, count=5)
    shapes = jax.eval_shape(lambda: init_state(optimizer))
    first = init_state(optimizer)  # (made outside the count: its eager operations compile too)
    with count_compiles() as compiles:
        ahead = CompiledAhead(steps, shapes)  # compiling on its thread from here
        state, metrics = ahead(first)
        state, metrics = ahead(state)  # (the compiled program again)
        jax.block_until_ready(state)
    assert len(compiles) == 1
    want, want_metrics = steps(steps(init_state(optimizer))[0])
    jax.tree.map(np.testing.assert_array_equal, (state, metrics), (want, want_metrics))


def test_a_program_compiled_ahead_raises_its_compiles_error_at_the_call():
    def bad_loss(params, batch, dropout_key):
        return loss_fn(params, batch, dropout_key)[0], {"loss": 0.0}  # aux may not name "loss"

    optimizer = optax.adam(LR)
    ahead = CompiledAhead(make_train_steps(bad_loss, optimizer, make_batch, seed=0, count=2),
                          jax.eval_shape(lambda: init_state(optimizer)))
    with pytest.raises(ValueError, match="loss_fn must return"):
        ahead(init_state(optimizer))


TINY_VANILLA = VanillaConfig(src_vocab_size=19, tgt_vocab_size=19, n_layer=1, d_model=32, d_ff=64, n_head=2,
                             max_seq_len=16)


@pytest.mark.parametrize("model", [Decoder(SMALL.replace(qk_norm=True, tie_embeddings=False)),
                                   VanillaTransformer(TINY_VANILLA)], ids=["decoder", "encoder-decoder"])
def test_initial_parameters_compiled_as_a_runs_are_the_default_compiles_bits(model, optimized_programs):
    """`init_params` compiles with `compiler_options` (LLVM -O2 on a CPU); XLA's default (-O3)
    must draw the same bits, so a run's weights do not depend on the setting."""
    default = jax.jit(model.init)(jax.random.key(3), *model.init_inputs())["params"]
    jax.tree.map(np.testing.assert_array_equal, init_params(model, 3), default)
    assert compiler_options() == ({"xla_backend_optimization_level": 2} if jax.default_backend() == "cpu" else None)


def test_create_copies_params():
    optimizer = optax.adam(LR)
    params = {"w": jnp.ones((IN, 1)), "b": jnp.zeros((1,))}
    state = TrainState.create(params, optimizer)
    make_train_step(loss_fn, optimizer)(state, make_batch(jax.random.key(0)), jax.random.key(1))
    assert not params["w"].is_deleted()


def test_step_keys_are_a_function_of_seed_and_step():
    a, b = step_keys(3, 7), step_keys(3, 7)
    data, dropout = (jax.random.key_data(k) for k in a)
    np.testing.assert_array_equal(data, jax.random.key_data(b[0]))
    assert not np.array_equal(data, dropout)
    assert not np.array_equal(data, jax.random.key_data(step_keys(3, 8)[0]))
    assert not np.array_equal(data, jax.random.key_data(step_keys(4, 7)[0]))
    with pytest.raises(ValueError, match="step"):
        step_keys(0, -1)


def test_step_keys_take_numpy_ints_and_refuse_what_would_collide():
    same = [jax.random.key_data(k) for k in step_keys(np.int64(3), np.int32(7))]
    for x, y in zip(same, (jax.random.key_data(k) for k in step_keys(3, 7))):
        np.testing.assert_array_equal(x, y)
    # jax.random.key(2**32) draws what key(0) draws: a seed past 31 bits would silently repeat another.
    for seed, step in ((2**31, 0), (-1, 0), (True, 0), (0, 2**32), (0, -1), (0, 1.0)):
        with pytest.raises(ValueError, match="must be an int in"):
            step_keys(seed, step)
