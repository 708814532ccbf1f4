"""Training any model: a train state, one jitted step, and a resumable loop.

    from jaxformer.training import TrainState, make_train_step, train_loop

    state = TrainState.create(params, optimizer)
    step = make_train_step(loss_fn, optimizer)   # loss_fn(params, batch, dropout_key) -> (loss, {metrics})
    state = train_loop(state, step, make_batch, seed=0, num_steps=100, run_dir="runs/mine",
                       checkpoint_every=50, log_every=10)

`make_batch(data_key) -> batch` draws one batch from a key. The pieces, the run directory,
resuming and the device mesh: docs/training.md and docs/sharding.md.
"""

from jaxformer.training.averaging import average_last, averaged
from jaxformer.training.checkpoints import CHECKPOINT_DIR, UNRESTORABLE_DIR, Checkpointer, Restored
from jaxformer.training.loop import Diverged, resume_from, train_loop
from jaxformer.training.metrics import METRICS_FILE, MetricsLog, read_metrics
from jaxformer.training.placement import shard_batches, shard_state
from jaxformer.training.progress import ProgressBar
from jaxformer.training.run_dir import (
                                       CONFIG_FILE,
                                       RunLock,
                                       check_run_config,
                                       check_run_dir,
                                       check_writable,
                                       lock_run_dir,
                                       read_run_config,
                                       save_run_config,
                                       start_run,
)
from jaxformer.training.state import TrainState, make_train_step, make_train_steps, step_keys
from jaxformer.validation import check_seed

__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "METRICS_FILE",
    "UNRESTORABLE_DIR",
    "Checkpointer",
    "Diverged",
    "MetricsLog",
    "ProgressBar",
    "Restored",
    "RunLock",
    "TrainState",
    "average_last",
    "averaged",
    "check_run_config",
    "check_run_dir",
    "check_seed",
    "check_writable",
    "lock_run_dir",
    "make_train_step",
    "make_train_steps",
    "read_metrics",
    "read_run_config",
    "resume_from",
    "save_run_config",
    "shard_batches",
    "shard_state",
    "start_run",
    "step_keys",
    "train_loop",
]
