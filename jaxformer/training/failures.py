"""How a command that trains ends when its run cannot go on: in one line (status 1) that
says why and what the run directory keeps, never a traceback. The causes are the run's,
not bugs: the run directory cannot be written (a full disk), the loss stopped being
finite (`jaxformer.training.Diverged`), a figure it computed is not
(`jaxformer.validation.NotFinite`), a user's code it calls failed (a reward function,
`jaxformer.validation.UserCodeFailed`), or the device ran out of memory. Anything else is
raised as it is: its traceback is the report. Before the line, the run is let go
(`Start.abandon`): a new run that kept nothing is undone, and the lock released.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from jaxformer.command_line import FAILED, describe_os_error, fail
from jaxformer.training.checkpoints import committed_steps
from jaxformer.training.loop import Diverged
from jaxformer.validation import NotFinite, UserCodeFailed


def kept(run_dir: Path) -> str:
    """What an interrupted or failed run leaves, and how to go on from it."""
    steps = committed_steps(run_dir)
    if not steps:
        return f"no checkpoint had been saved, so nothing of the run in {run_dir} was kept"
    return (f"checkpoint {steps[-1]} is kept in {run_dir}: continue from it with the same flags and "
            f"--resume --run-dir {run_dir}")


@contextlib.contextmanager
def failing_as(begun):
    """Ends the command in one line (status 1) when the run cannot go on (see the module's
    docstring).

    Args:
      begun: the run (`jaxformer.training.run_start.Start`): its command, run directory,
        and `abandon()`.
    """
    try:
        yield
    except (NotFinite, UserCodeFailed) as e:
        begun.abandon()
        fail(begun.prog, f"{e}; {kept(begun.run_dir)}", FAILED)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise  # a bug, not the size: its traceback is the report
        begun.abandon()
        fail(begun.prog, f"out of memory: {str(e).splitlines()[0]}; {kept(begun.run_dir)}. A smaller --batch-size "
                         "or --seq-len needs less", FAILED)
    except Diverged as e:
        begun.abandon()
        where = (f"{begun.run_dir} keeps it" if e.checkpoint is not None
                 else f"nothing of the run in {begun.run_dir} was kept")
        fail(begun.prog, f"{e}; {where}. The same recipe diverges again from there: start a new run with a smaller "
                         "learning rate", FAILED)
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and not isinstance(e.__cause__, OSError):
            raise  # a bug, not the disk: its traceback is the report
        begun.abandon()
        reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
        fail(begun.prog, f"cannot write {reason.removeprefix('cannot write ')}; {kept(begun.run_dir)}", FAILED)
