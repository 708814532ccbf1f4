"""`jaxformer.training.averaging`: the mean of the parameters after the last evenly spaced
updates, kept in the optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from linear_regression import LR, init_state, loss_fn, make_batch

from jaxformer.training import TrainState, average_last, averaged, make_train_step, resume_from, step_keys, train_loop


def test_the_average_is_the_mean_of_the_parameters_after_the_chosen_updates():
    """10 updates, 3 points 3 apart: the mean of the parameters after updates 4, 7 and 10,
    recorded one update at a time; the updates themselves are the wrapped optimizer's."""
    plain, wrapped = optax.adam(LR), average_last(optax.adam(LR), 3, 3, 10)
    step, averaging = make_train_step(loss_fn, plain), make_train_step(loss_fn, wrapped)
    a, b, seen = init_state(plain), init_state(wrapped), {}
    for s in range(10):
        data_key, dropout_key = step_keys(0, s)
        a, _ = step(a, make_batch(data_key), dropout_key)
        b, _ = averaging(b, make_batch(data_key), dropout_key)
        seen[s + 1] = jax.device_get(a.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    want = jax.tree.map(lambda *p: np.mean(p, axis=0), seen[4], seen[7], seen[10])
    for x, y in zip(jax.tree.leaves(averaged(b.opt_state, b.params)), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_a_resumed_run_averages_what_the_uninterrupted_one_does(tmp_path):
    optimizer = average_last(optax.sgd(LR), 4, 2, 12)
    step = make_train_step(loss_fn, optimizer)
    common = dict(seed=2, num_steps=12, checkpoint_every=3, log_every=3, progress=False)
    a = train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "a", **common)
    train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "b", **{**common, "num_steps": 9})
    b = train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "b",
                   resume=resume_from(tmp_path / "b", init_state(optimizer), 12), **common)
    for x, y in zip(jax.tree.leaves(averaged(a.opt_state, a.params)), jax.tree.leaves(averaged(b.opt_state, b.params))):
        np.testing.assert_array_equal(x, y)


def test_points_that_do_not_fit_are_refused_and_before_the_first_the_last_parameters_stand():
    with pytest.raises(ValueError, match="5 points 50 updates apart do not fit in 100 updates"):
        average_last(optax.sgd(LR), 5, 50, 100)
    state = TrainState.create({"w": jnp.ones(2)}, average_last(optax.sgd(LR), 2, 1, 5))
    assert averaged(state.opt_state, state.params) is state.params


def test_a_run_resumed_with_other_steps_trains_bitwise_and_keeps_its_points(tmp_path):
    """The kept updates are in the state, not the compiled update: a run of 12 steps stopped
    at 6 and resumed to 8 with an optimizer built for 8 trains as the 12-step run did, and
    has kept that run's points up to 8 (6 and 8: points 6, 8, 10, 12)."""
    step12 = make_train_step(loss_fn, average_last(optax.adam(LR), 4, 2, 12))
    opt8 = average_last(optax.adam(LR), 4, 2, 8)
    common = dict(seed=4, checkpoint_every=2, log_every=2, progress=False)
    a = train_loop(init_state(average_last(optax.adam(LR), 4, 2, 12)), step12, make_batch,
                   run_dir=tmp_path / "a", num_steps=8, **common)
    train_loop(init_state(average_last(optax.adam(LR), 4, 2, 12)), step12, make_batch, run_dir=tmp_path / "b",
               num_steps=6, **common)
    b = train_loop(init_state(opt8), make_train_step(loss_fn, opt8), make_batch, run_dir=tmp_path / "b",
                   resume=resume_from(tmp_path / "b", init_state(opt8), 8), num_steps=8, **common)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert int(b.opt_state.kept) == 2
