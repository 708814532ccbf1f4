"""`jaxformer.training.loop`: a resumed run equals the uninterrupted one, bitwise."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from linear_regression import LR, init_state, loss_fn, make_batch

from jaxformer.training import (
    UNRESTORABLE_DIR,
    Checkpointer,
    Diverged,
    TrainState,
    make_train_step,
    make_train_steps,
    read_metrics,
    resume_from,
    train_loop,
)


class Crash(Exception):
    pass


def crash_after(num_batches):
    """A make_batch that raises when asked for batch number `num_batches + 1`."""
    calls = []

    def batches(data_key):
        if len(calls) == num_batches:
            raise Crash
        calls.append(1)
        return make_batch(data_key)
    return batches


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    schedule = optax.linear_schedule(LR, 0.0, 20)
    optimizer = optax.adam(schedule)
    train_step = make_train_step(loss_fn, optimizer)
    common = dict(seed=1, num_steps=20, checkpoint_every=5, log_every=1, lr_schedule=schedule, progress=False)

    a = train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "a", **common)

    # B crashes while preparing update 12 (12 updates done): checkpoints 5 and 10 exist,
    # the metrics log runs to step 12, and there is no checkpoint 12.
    with pytest.raises(Crash):
        train_loop(init_state(optimizer), train_step, crash_after(12), run_dir=tmp_path / "b", **common)
    assert Checkpointer(tmp_path / "b").latest_step() == 10
    assert read_metrics(tmp_path / "b" / "metrics.jsonl")[-1]["step"] == 12
    restored = resume_from(tmp_path / "b", init_state(optimizer), 20)
    b = train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "b", resume=restored, **common)

    assert int(a.step) == int(b.step) == 20
    for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state))):
        np.testing.assert_array_equal(x, y)  # bitwise, not approximately
    log_a, log_b = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("a", "b"))
    assert [r["step"] for r in log_b] == [r["step"] for r in log_a] == list(range(1, 21))
    assert [(r["loss"], r["mae"]) for r in log_b] == [(r["loss"], r["mae"]) for r in log_a]
    assert log_a[0]["lr"] == pytest.approx(LR) and set(log_a[0]) == {"step", "loss", "mae", "lr", "steps_per_sec"}
    assert Checkpointer(tmp_path / "a").latest_step() == 20
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "15", "20"]


def test_train_loop_refuses_to_overwrite_a_run(tmp_path):
    optimizer = optax.adam(LR)
    train_step = make_train_step(loss_fn, optimizer)
    kwargs = dict(seed=0, num_steps=2, run_dir=tmp_path, checkpoint_every=2, log_every=1, progress=False)
    train_loop(init_state(optimizer), train_step, make_batch, **kwargs)
    with pytest.raises(ValueError, match=r"pass resume=resume_from\(\.\.\.\) to continue that run"):
        train_loop(init_state(optimizer), train_step, make_batch, **kwargs)


def test_the_documented_example_runs(tmp_path):
    """The package docstring's example, with exactly its names and keywords."""
    from jaxformer.training import TrainState
    optimizer = optax.adam(LR)
    params = init_state(optimizer).params
    state = TrainState.create(params, optimizer)
    step = make_train_step(loss_fn, optimizer)
    state = train_loop(state, step, make_batch, seed=0, num_steps=100, run_dir=tmp_path / "mine",
                       checkpoint_every=50, log_every=10)
    assert int(state.step) == 100
    assert [r["step"] for r in read_metrics(tmp_path / "mine" / "metrics.jsonl")] == list(range(10, 101, 10))
    assert Checkpointer(tmp_path / "mine").latest_step() == 100


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys):
    """Checkpoint 20 cut short: the run resumes from 15, sets 20 aside, and ends bitwise where
    an undamaged run ends; a resume below the reached step, or with no checkpoint, is refused."""
    schedule = optax.linear_schedule(LR, 0.0, 20)
    optimizer = optax.adam(schedule)
    train_step = make_train_step(loss_fn, optimizer)
    common = dict(seed=1, num_steps=20, checkpoint_every=5, log_every=1, lr_schedule=schedule, progress=False)
    a = train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "a", **common)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "checkpoints" / "20" / "default" / "_METADATA").write_text("{garbled")

    with pytest.raises(ValueError, match="num_steps 12 is below step 15, which the run in .* has reached: pass "
                                         "num_steps 15 or more"):
        resume_from(tmp_path / "b", init_state(optimizer), 12)
    restored = resume_from(tmp_path / "b", init_state(optimizer), 20)
    with pytest.raises(ValueError, match="num_steps 12 is below step 15"):
        train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "b", resume=restored,
                   **{**common, "num_steps": 12})
    with pytest.raises(TypeError, match="train_loop resume must be None or the Restored of resume_from"):
        train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "b", resume=True, **common)
    capsys.readouterr()
    b = train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "b", resume=restored, **common)
    err = capsys.readouterr().err
    assert err.startswith("checkpoint 20 does not restore (JSONDecodeError: ") and err.count("\n") == 1, err
    assert (tmp_path / "b" / UNRESTORABLE_DIR / "20" / "default" / "_METADATA").read_text() == "{garbled"
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert read_metrics(tmp_path / "a" / "metrics.jsonl") != [] and [
        (r["step"], r["loss"]) for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [
        (r["step"], r["loss"]) for r in read_metrics(tmp_path / "a" / "metrics.jsonl")]

    with pytest.raises(ValueError, match="holds no checkpoint to resume from"):
        resume_from(tmp_path / "c", init_state(optimizer), 20)
    assert not (tmp_path / "c").exists()


def test_updates_scanned_in_one_call_are_the_updates_made_one_by_one(tmp_path):
    """`make_train_steps`' scan of 4 updates draws each update's batch and dropout from its
    own keys, as the loop does: the same losses and parameters as one update a call (to
    float32 rounding: the scan is another program), with log lines and checkpoints where
    they were; the steps between lines go 4 at a time, the rest one by one."""
    schedule = optax.linear_schedule(LR, 0.0, 22)
    optimizer = optax.adam(schedule)
    common = dict(seed=3, num_steps=22, checkpoint_every=8, log_every=4, lr_schedule=schedule, progress=False)
    one = train_loop(init_state(optimizer), make_train_step(loss_fn, optimizer), make_batch, run_dir=tmp_path / "a",
                     **common)
    calls = []
    scanned = make_train_steps(loss_fn, optimizer, make_batch, 3, 4)

    def counted(state):
        calls.append(int(state.step))
        return scanned(state)

    many = train_loop(init_state(optimizer), make_train_step(loss_fn, optimizer), make_batch,
                      run_dir=tmp_path / "b", train_steps=(4, counted), **common)
    assert calls == [0, 4, 8, 12, 16]  # 20 and 21: one by one, the end comes first
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    log_one, log_many = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("a", "b"))
    assert [r["step"] for r in log_many] == [r["step"] for r in log_one] == [4, 8, 12, 16, 20, 22]
    np.testing.assert_allclose([r["loss"] for r in log_many], [r["loss"] for r in log_one], rtol=1e-6)
    assert [r["lr"] for r in log_many] == [r["lr"] for r in log_one]
    assert Checkpointer(tmp_path / "b").all_steps() == Checkpointer(tmp_path / "a").all_steps()


def test_a_run_of_scanned_updates_resumes_bitwise(tmp_path):
    """Which updates go in one call depends on the step alone, so a resumed run makes the
    calls the uninterrupted one made."""
    optimizer = optax.adam(LR)
    step, many = make_train_step(loss_fn, optimizer), (4, make_train_steps(loss_fn, optimizer, make_batch, 1, 4))
    common = dict(seed=1, num_steps=24, checkpoint_every=12, log_every=4, progress=False, train_steps=many)
    a = train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "a", **common)
    train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "b", **{**common, "num_steps": 12})
    b = train_loop(init_state(optimizer), step, make_batch, run_dir=tmp_path / "b",
                   resume=resume_from(tmp_path / "b", init_state(optimizer), 24), **common)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_a_loss_that_stops_being_finite_inside_a_scan_names_its_own_update(tmp_path):
    """Update 6, inside the call of updates 5 to 8, is the first whose loss is NaN: the run
    stops at that call's log line naming update 6, checkpoint 4 the newest it kept."""
    optimizer = optax.sgd(LR)

    def climbing(params, batch, dropout_key):  # w = (u - 1) LR at update u; NaN from update 6 on
        return jnp.where(params["w"] > 4.5 * LR, jnp.nan, -params["w"]), {}

    with pytest.raises(Diverged) as diverged:
        train_loop(TrainState.create({"w": jnp.zeros(())}, optimizer), make_train_step(climbing, optimizer),
                   make_batch, seed=0, num_steps=12, run_dir=tmp_path, checkpoint_every=4, log_every=4,
                   progress=False, train_steps=(4, make_train_steps(climbing, optimizer, make_batch, 0, 4)))
    assert diverged.value.step == 6 and diverged.value.checkpoint == 4
