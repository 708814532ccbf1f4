"""`jaxformer.training.checkpoints`: orbax's atomic step directories, and restore."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from linear_regression import LR, init_state, loss_fn, make_batch

from jaxformer.training import Checkpointer, make_train_step


def test_half_written_checkpoint_is_never_restored(tmp_path):
    optimizer = optax.adam(LR)
    state = init_state(optimizer)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state.replace(step=jnp.array(5, jnp.int32)))
    # What a crash during the save of step 8 leaves: orbax's temporary directory, here
    # even with every file of a complete checkpoint in it, but never renamed to "8".
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(ckpt_dir / "5", ckpt_dir / "8.orbax-checkpoint-tmp")

    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 5
        assert int(ckpt.restore(state).step) == 5
        # Orbax deletes leftovers in the background from opening, at the latest before
        # the next save starts.
        ckpt.save(state.replace(step=jnp.array(6, jnp.int32)))
        assert not (ckpt_dir / "8.orbax-checkpoint-tmp").exists()


def test_restore_keeps_structure_and_values(tmp_path):
    optimizer = optax.adam(LR)
    state = init_state(optimizer)
    state, _ = make_train_step(loss_fn, optimizer)(state, make_batch(jax.random.key(0)), jax.random.key(1))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
        ckpt.wait()
        restored = ckpt.restore(init_state(optimizer))
        with pytest.raises(ValueError, match="already holds step 1"):
            ckpt.save(state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(x, y)
