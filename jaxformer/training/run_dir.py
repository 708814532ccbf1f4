"""A run directory's `config.json`: what a resumed run must match.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per logged step)
and `checkpoints/<step>/`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.files import write_text_atomically

CONFIG_FILE = "config.json"


def start_run(run_dir, config: dict, resume: bool) -> None:
    """Checks and records a run's config in `run_dir` before training starts.

    Args:
      run_dir: the run directory; created if missing.
      config: a JSON-serialisable dict of what a resumed run must match (the model, the
        recipe, the seed; not: how long to train or how often to log).
      resume: whether this continues the run already in `run_dir`.

    Raises:
      ValueError: resuming a run directory that holds a different config, or starting a
        new run in a directory that is not empty (its checkpoints would be mixed in).
    """
    run_dir = Path(run_dir)
    if resume:
        check_run_config(run_dir, config)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} is not empty: resume that run (--resume), or choose a new run directory")
    save_run_config(run_dir, config)


def save_run_config(run_dir, config: dict) -> None:
    """Writes `config` to `run_dir/config.json` atomically.

    Args:
      run_dir: the run directory; created if missing.
      config: a JSON-serialisable dict.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / CONFIG_FILE, json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")


def check_run_config(run_dir, config: dict) -> None:
    """Checks that resuming `run_dir` with `config` continues the same run.

    Does nothing if `run_dir` holds no config yet.

    Args:
      run_dir: the run directory.
      config: the config the resumed run would use.

    Raises:
      ValueError: naming each key whose saved and given values differ (or that only one
        of them has).
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return
    saved, given = json.loads(path.read_text()), _jsonable(config)
    missing = "<missing>"
    differing = sorted(k for k in saved.keys() | given.keys() if saved.get(k, missing) != given.get(k, missing))
    if differing:
        details = ", ".join(f"{k} (saved {saved.get(k, missing)!r}, given {given.get(k, missing)!r})"
                            for k in differing)
        raise ValueError(f"{path} holds a different config: {details}; "
                         "resume with the saved config or use a new run directory")


def _jsonable(config: dict) -> dict:
    """`config` as it reads back from JSON (tuples become lists), so that a config
    compares equal to its saved copy."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (got {type(config).__name__})")
    return json.loads(json.dumps(config))
