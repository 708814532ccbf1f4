"""A run directory, started and resumed as a transaction.

A run directory holds `config.json` (what a resumed run must match), `metrics.jsonl`
(one JSON object per logged step) and `checkpoints/<step>/`. Starting or resuming a run
checks everything first (`check_run_dir`) and writes only then (`start_run`), so a
command that is refused leaves the directory as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxformer.files import write_text_atomically

CONFIG_FILE = "config.json"


def check_run_dir(run_dir, config: dict | None, resume: bool) -> None:
    """Checks, reading only, that a run can start in (or resume from) `run_dir`.

    Args:
      run_dir: the run directory.
      config: what a resumed run must match (see `start_run`); None checks only the
        location (whether the directory can be started or resumed at all).
      resume: whether the run continues the one in `run_dir`.

    Raises:
      ValueError, in one line naming the path: a new run's directory that is a file,
        not empty, or cannot be created; a resumed one that does not exist, holds no
        or an unreadable `config.json`, or holds a different config.
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
        if config is not None:
            check_run_config(run_dir, config, saved)
    elif run_dir.exists():
        if any(run_dir.iterdir()):
            raise ValueError(f"{run_dir} is not empty: resume that run (--resume), or choose a new run directory")
    else:
        _check_creatable(run_dir)


def start_run(run_dir, config: dict, resume: bool) -> None:
    """Checks `run_dir` (`check_run_dir`), then, for a new run, creates it and writes its config.

    A resumed run's `config.json` is left as it is: it is written once, atomically.

    Args:
      run_dir: the run directory; created if missing.
      config: a JSON-serialisable dict of what a resumed run must match (the model, the
        recipe, the seed; not: how long to train or how often to log).
      resume: whether this continues the run already in `run_dir`.

    Raises:
      ValueError: see `check_run_dir`; also when the directory cannot be written.
    """
    check_run_dir(run_dir, config, resume)
    if not resume:
        save_run_config(run_dir, config)


def save_run_config(run_dir, config: dict) -> None:
    """Writes `config` to `run_dir/config.json` atomically.

    Args:
      run_dir: the run directory; created if missing.
      config: a JSON-serialisable dict.

    Raises:
      ValueError: naming the directory, when it cannot be created or written.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(run_dir / CONFIG_FILE, json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise ValueError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from e


def read_run_config(run_dir) -> dict:
    """The config saved in `run_dir/config.json`.

    Raises:
      ValueError: naming the file, when it is missing, not valid JSON or not an object.
    """
    path = Path(run_dir) / CONFIG_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a {type(saved).__name__}, not a run config (a JSON object)")
    return saved


def check_run_config(run_dir, config: dict, saved: dict | None = None) -> None:
    """Checks that resuming `run_dir` with `config` continues the same run.

    Args:
      run_dir: the run directory.
      config: the config the resumed run would use.
      saved: the saved config, if already read (`read_run_config(run_dir)`).

    Raises:
      ValueError: naming the file and each key whose saved and given values differ (or
        that only one of them has), nested keys dotted (`model.d_model`); see
        `read_run_config` for an unreadable file.
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
    """`config` as it reads back from JSON (tuples become lists), so that a config
    compares equal to its saved copy."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (got {type(config).__name__})")
    return json.loads(json.dumps(config))
