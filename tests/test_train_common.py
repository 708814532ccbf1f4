"""The shared training machinery, on a tiny linear regression with input dropout."""

import io
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import count_compiles

from train.common import (
    Checkpointer,
    MetricsLog,
    ProgressBar,
    TrainState,
    check_run_config,
    make_train_step,
    read_metrics,
    save_run_config,
    step_keys,
    train_loop,
)

IN, BATCH, LR = 4, 16, 0.1
W_TRUE = jnp.array([[1.0], [-2.0], [0.5], [3.0]])


def make_batch(data_key):
    kx, kn = jax.random.split(data_key)
    x = jax.random.normal(kx, (BATCH, IN))
    return {"x": x, "y": x @ W_TRUE + 0.7 + 0.01 * jax.random.normal(kn, (BATCH, 1))}


def loss_fn(params, batch, dropout_key):
    # Input dropout, so that the resume test also checks the dropout keys.
    keep = jax.random.bernoulli(dropout_key, 0.95, batch["x"].shape)
    pred = (batch["x"] * keep / 0.95) @ params["w"] + params["b"]
    err = pred - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def init_state(optimizer):
    return TrainState.create({"w": jnp.zeros((IN, 1)), "b": jnp.zeros((1,))}, optimizer)


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
    b = train_loop(init_state(optimizer), train_step, make_batch, run_dir=tmp_path / "b", resume=True, **common)

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
    with pytest.raises(ValueError, match="resume=True"):
        train_loop(init_state(optimizer), train_step, make_batch, **kwargs)


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


def test_run_config_round_trip_and_mismatch(tmp_path):
    config = {"lr": 1e-3, "d_model": 64, "shape": (2, 3)}
    check_run_config(tmp_path, config)  # nothing saved yet: nothing to compare
    save_run_config(tmp_path, config)
    check_run_config(tmp_path, config)  # the tuple reads back as a list and still matches
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temp file left
    with pytest.raises(ValueError, match=r"d_model \(saved 64, given 128\)") as err:
        check_run_config(tmp_path, {**config, "d_model": 128})
    assert "lr" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="seed"):
        check_run_config(tmp_path, {**config, "seed": 0})


def test_metrics_log_truncate_and_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 7):
        log.write(step, loss=np.float32(1.0 / step), lr=0.1)
    assert read_metrics(path)[2] == {"step": 3, "loss": pytest.approx(1 / 3), "lr": 0.1}
    log.truncate_after(4)
    log.write(5, loss=0.5)
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_progress_bar_prints_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(100, initial=0, every=25, stream=out)
    for step in range(10, 101, 10):
        bar.update(step, loss=2.0 / step, lr=1e-3, steps_per_sec=12.34)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split("/")[0].strip() for line in lines] == ["30", "50", "80", "100"]
    assert lines[-1].startswith("100/100 [" + "#" * ProgressBar.WIDTH + "]")
    assert "loss 0.0200" in lines[-1] and "lr 1.00e-03" in lines[-1] and "12.3 steps/s" in lines[-1]


@pytest.mark.parametrize("env, called_with", [
    ({}, None),  # one host: nothing to join
    ({"SLURM_NTASKS": "1"}, None),
    ({"SLURM_NTASKS": "4"}, {}),  # jax reads Slurm's variables itself
    ({"TPU_WORKER_HOSTNAMES": "host0,host1"}, {}),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     {"num_processes": 2, "process_id": 1}),
])
def test_initialize_distributed_only_when_the_environment_names_other_hosts(monkeypatch, env, called_with):
    from train import common
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                 "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(common.jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    assert common.initialize_distributed() == (called_with is not None)
    assert calls == ([] if called_with is None else [called_with])
