"""`jaxformer.training.checkpoints`: orbax's atomic step directories, and restore."""

import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from linear_regression import LR, init_state, loss_fn, make_batch

from jaxformer.quantized import QArray
from jaxformer.training import UNRESTORABLE_DIR, Checkpointer, TrainState, checkpoints, make_train_step


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


def test_quantized_matrices_restore_bit_for_bit(tmp_path):
    """A `QArray` of each stored form restores with its values, scales and zero point bit for bit, each in its
    own dtype: int8; int4; uint4 (affine int4's values and zero points, NF4's code indices: 0..15, which
    orbax cannot store as uint4: they travel as uint8); MXFP4's e2m1 codes (uint4 too); FP8's float8 e4m3."""
    rng = np.random.default_rng(0)

    def values(dtype, low, high):  # [16, 8], every value of the range drawn
        return jnp.asarray(rng.integers(low, high, (16, 8)).astype(dtype))

    def scale(rows):
        return jnp.asarray(rng.random((rows, 8)) + 0.5, jnp.bfloat16)

    params = {"int8": QArray(values(np.int8, -127, 128), scale(1)),
              "int4": QArray(values(ml_dtypes.int4, -7, 8), scale(2)),
              "int4-affine": QArray(values(ml_dtypes.uint4, 0, 16), scale(2), values(ml_dtypes.uint4, 0, 16)[:2]),
              "nf4": QArray(values(ml_dtypes.uint4, 0, 16), scale(2), qtype="nf4"),
              "mxfp4": QArray(values(ml_dtypes.uint4, 0, 16), jnp.exp2(jnp.round(scale(1))), qtype="mxfp4"),
              "fp8": QArray(jnp.asarray(rng.normal(size=(16, 8)).astype(ml_dtypes.float8_e4m3fn)), scale(1))}
    assert int(np.asarray(params["nf4"].qvalue).max()) == 15  # (a uint4 read back as int4 would not hold it)
    state = TrainState(step=jnp.array(7, jnp.int32), params=params, opt_state=())
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
        ckpt.wait()
        restored = ckpt.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)  # (each QArray's format, nf4's, with it)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state), strict=True):
        assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes(), jax.tree_util.keystr(path)


def saved_run(tmp_path, steps=(5, 10, 15)):
    """A checkpoint directory holding `steps`, each a state whose step is its name."""
    optimizer = optax.adam(LR)
    state = init_state(optimizer)
    with Checkpointer(tmp_path) as ckpt:
        for step in steps:
            ckpt.save(state.replace(step=jnp.array(step, jnp.int32)))
    return state


def files_under(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def truncate_largest_file(checkpoint):
    largest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:40])


def garble_metadata(checkpoint):
    (checkpoint / "default" / "_METADATA").write_text("{garbled")


@pytest.mark.parametrize("damage", [truncate_largest_file, garble_metadata])
def test_restore_newest_skips_damaged_checkpoints_and_touches_nothing(tmp_path, damage):
    state = saved_run(tmp_path)
    damage(tmp_path / "checkpoints" / "15")
    before = files_under(tmp_path)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        restored = ckpt.restore_newest(state)
    assert restored.step == int(restored.state.step) == 10
    (step, why), = restored.unrestorable
    assert step == 15 and "\n" not in why and why
    assert files_under(tmp_path) == before

    damage(tmp_path / "checkpoints" / "10")
    damage(tmp_path / "checkpoints" / "5")
    before = files_under(tmp_path)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        with pytest.raises(ValueError, match=r"no checkpoint in .* restores \(step 15: .*; step 10: .*; step 5: ") as e:
            ckpt.restore_newest(state)
    assert "\n" not in str(e.value)
    assert files_under(tmp_path) == before


def test_restore_newest_of_nothing_and_set_aside(tmp_path):
    state = init_state(optax.adam(LR))
    (tmp_path / "checkpoints").mkdir()
    with Checkpointer(tmp_path, read_only=True) as ckpt, pytest.raises(ValueError, match="holds no checkpoint"):
        ckpt.restore_newest(state)
    saved_run(tmp_path, steps=(5, 10))
    with Checkpointer(tmp_path) as ckpt:
        moved = ckpt.set_aside(10)
        assert moved == tmp_path / UNRESTORABLE_DIR / "10" and (moved / "commit_success.txt").exists()
        assert ckpt.all_steps() == [5] and ckpt.latest_step() == 5
        ckpt.save(state.replace(step=jnp.array(10, jnp.int32)))  # step 10 can be written again
        ckpt.wait()
        assert ckpt.set_aside(10) == tmp_path / UNRESTORABLE_DIR / "10-1"  # the first one is kept


def test_a_reader_of_a_live_run_lists_again_and_removes_nothing(tmp_path, monkeypatch):
    """A save that commits while a reader's orbax lists the folder makes the listing fail on
    a vanished name (FileNotFoundError): the reader lists again, and never removes the live
    run's unfinished save."""
    saved_run(tmp_path, steps=(5, 10))
    unfinished = tmp_path / "checkpoints" / "15.orbax-checkpoint-tmp-1"
    unfinished.mkdir()
    real, calls = checkpoints.ocp.CheckpointManager, []

    def racing(*args, **kwargs):  # the first listing meets a folder renamed under it
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "checkpoints" / "15.orbax-tmp"))
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints.ocp, "CheckpointManager", racing)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.all_steps() == [5, 10]
    assert len(calls) == 2 and unfinished.is_dir()
