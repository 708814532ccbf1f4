"""A run directory, started and resumed as a transaction: everything is checked first
(`check_run_dir`), written only then (`start_run`), by one run at a time (`lock_run_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from jaxformer.files import read_json_object, write_text_atomically
from jaxformer.runtime import on_primary
from jaxformer.training.checkpoints import CHECKPOINT_DIR

CONFIG_FILE = "config.json"


class RunLock:
    """This run's exclusive lock on a run directory; `release()` (or `with`) ends it.

    `flock` on the directory itself: taking it writes nothing, and the system drops it
    however the process ends. Within one process it is counted, not refused (`train_loop`
    inside a command that locked its run first). A run of several processes shares one run
    directory: process 0 holds the flock for all of them, and the others hold its count.
    """

    _held: dict[Path, list] = {}  # resolved directory -> [fd (None off process 0), holders], this process's locks

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._key = run_dir.resolve()
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Lets the lock go (once; later calls do nothing)."""
        if self._released:
            return
        self._released = True
        entry = RunLock._held[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            del RunLock._held[self._key]
            if entry[0] is not None:
                os.close(entry[0])  # closing the last descriptor releases the flock

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir) -> RunLock:
    """The `RunLock` of an existing run directory, held until released or the process ends.

    In a run of several processes every one calls it at the same point: process 0 takes the
    flock, and all of them go on or raise together (`jaxformer.runtime.on_primary`).

    Raises:
      ValueError: naming the directory, when another run holds its lock.
    """
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in RunLock._held:
        RunLock._held[key][1] += 1
        return RunLock(run_dir)
    RunLock._held[key] = [on_primary(lambda: _flock(run_dir)), 1]
    return RunLock(run_dir)


def _flock(run_dir: Path) -> int:
    """An open descriptor of `run_dir` holding its exclusive flock."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"run directory {run_dir} is in use by another process (a run, a resume or a report "
                         "rebuild of it): wait for it to end, or stop it") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_writable(directory, purpose: str) -> None:
    """Raises ValueError, naming `directory` and `purpose` (what would be written), unless this
    process can write in it.
    """
    directory = Path(directory)
    if os.access(directory, os.W_OK | os.X_OK):
        return
    with contextlib.suppress(OSError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            raise ValueError(f"{directory} is on a read-only file system: {purpose}")
    raise ValueError(f"{directory} is not writable by this user: {purpose}")


def check_run_dir(run_dir, config: dict | None, resume: bool) -> None:
    """Checks, reading only, that a run can start in (`resume` False) or resume from `run_dir`.

    Args:
      run_dir: the run directory.
      config: what a resumed run must match (see `start_run`); None checks the location only.
      resume: whether the run continues the one in `run_dir`.

    Raises:
      ValueError: in one line naming the path (a new run's directory not empty or not
        creatable; a resumed one missing, not writable, or with another `config.json`).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file, not a directory")
    if resume:
        if not run_dir.exists():
            raise ValueError(f"run directory {run_dir} does not exist: there is no run to resume")
        if not (run_dir / CONFIG_FILE).is_file():
            raise ValueError(f"{run_dir} holds no {CONFIG_FILE}: not a run directory to resume")
        saved = read_run_config(run_dir)
        for directory in (run_dir, run_dir / CHECKPOINT_DIR):
            if directory.is_dir():
                check_writable(directory, "a resumed run writes its checkpoints and metrics there")
        if config is not None:
            check_run_config(run_dir, config, saved)
    elif run_dir.exists():
        if any(run_dir.iterdir()):
            raise ValueError(f"{run_dir} is not empty: resume that run (--resume), or choose a new run directory")
    else:
        _check_creatable(run_dir)


def start_run(run_dir, config: dict, resume: bool) -> None:
    """Checks `run_dir` (`check_run_dir`), then, for a new run, creates it and writes its config.

    Args:
      run_dir: the run directory.
      config: a JSON-serialisable dict of what a resumed run must match (the model, the
        recipe, the seed; not how long to train or how often to log).
      resume: whether this continues the run already in `run_dir`.
    """
    check_run_dir(run_dir, config, resume)
    if not resume:
        save_run_config(run_dir, config)


def save_run_config(run_dir, config: dict) -> None:
    """Writes the JSON-serialisable `config` to `run_dir/config.json` (the directory created
    if missing), atomically; a ValueError naming the directory if it cannot be written."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(run_dir / CONFIG_FILE, json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise ValueError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from e


def read_run_config(run_dir) -> dict:
    """The config saved in `run_dir/config.json`; a ValueError naming the file if it is missing or damaged."""
    path = Path(run_dir) / CONFIG_FILE
    saved = read_run_file(path, "a run config (a JSON object)")
    if saved is None:
        raise ValueError(f"cannot read {path}: there is no such file")
    return saved


def read_run_file(path, what: str = "a JSON object") -> dict | None:
    """The JSON object of a run file (`config.json`, `about.json`, `eval.json`), None if absent;
    a ValueError naming the file when it is not `what` (a JSON object): the file is damaged.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        return read_json_object(path, what)
    except ValueError as e:
        raise ValueError(f"{e}: the file is damaged") from None


def check_run_config(run_dir, config: dict, saved: dict | None = None) -> None:
    """Checks that resuming `run_dir` with `config` continues the same run.

    Args:
      run_dir: the run directory.
      config: the config the resumed run would use.
      saved: the saved config, if already read.

    Raises:
      ValueError: naming the file and each differing key, dotted (`model.d_model`).
    """
    saved = _flat(read_run_config(run_dir) if saved is None else saved)
    given = _flat(_jsonable(config))
    missing = "<missing>"
    differing = sorted(k for k in saved.keys() | given.keys() if saved.get(k, missing) != given.get(k, missing))
    if differing:
        details = ", ".join(f"{k} (saved {saved.get(k, missing)!r}, given {given.get(k, missing)!r})"
                            for k in differing)
        raise ValueError(f"{Path(run_dir) / CONFIG_FILE} holds a different config: {details}; "
                         "resume with the saved config or use a new run directory")


def _check_creatable(run_dir: Path) -> None:
    """Raises unless the nearest existing ancestor of `run_dir` is a writable directory."""
    ancestor = run_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"run directory {run_dir} cannot be created: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"run directory {run_dir} cannot be created: {ancestor} is not writable")


def _flat(config: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys: `{"model": {"d": 1}}` -> `{"model.d": 1}`."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _jsonable(config: dict) -> dict:
    """`config` as it reads back from JSON (tuples become lists), to compare with its saved copy."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (got {type(config).__name__})")
    return json.loads(json.dumps(config))
