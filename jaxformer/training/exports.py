"""The folder a command that trains exports its model to (`--export` of `train.lm`,
`--merge` of `jaxformer-finetune`): checked when the flags are parsed, reading only, so
that a folder it could not replace is refused before any training; written once the run
is done, as one transaction, so that a reader sees the previous export whole or the new
one whole. Nothing a user saved there is replaced: only a previous export is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from jaxformer.files import write_folder_atomically
from jaxformer.runtime import is_primary
from jaxformer.text.tokenizer import GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

# What an export writes (`jaxformer.convert.save_hf`, then `jaxformer.text.save_tokenizer`):
# a folder that holds nothing else is a previous export, which the new one replaces whole.
EXPORT_FILES = (MODEL_CONFIG_FILE, GENERATION_CONFIG_FILE, "model.safetensors", TOKENIZER_FILE,
                TOKENIZER_CONFIG_FILE)


def check_export_dir(export: Path, run_dir: Path, flag: str = "--export") -> None:
    """Checks, reading only, that `--export` can be written once the run is done: a new
    or empty directory, or a previous export (nothing but `EXPORT_FILES`, and the
    temporary files a write of one that was cut short may have left), which the new
    export replaces. Not the run directory, nor another run's: their `config.json` is
    the run's own.

    Raises:
      ValueError: naming `flag`: a file, a path under a file, the run directory, or a
        directory that holds files an export does not write.
    """
    path = export.absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file, not a directory" if existing == path else f"cannot be created: {existing} is a file"
        raise ValueError(f"{flag} {export} {where}")
    if path.resolve() == run_dir.resolve():
        raise ValueError(f"{flag} {export} is the run directory: export to a folder of its own")
    others = sorted(name for name in (os.listdir(path) if existing == path else ()) if not _exported(name))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(f"{flag} {export} holds {shown}: not a previous export to replace "
                         f"(only {', '.join(EXPORT_FILES)}); choose an empty or new directory")


def _exported(name: str) -> bool:
    """Whether a file in an export folder is one an export writes, or the temporary file
    an atomic write of one leaves when it is cut short (`.<name>.XXXX.tmp`)."""
    return name in EXPORT_FILES or any(name.startswith(f".{file}.") and name.endswith(".tmp") for file in EXPORT_FILES)


def write_export(export: Path, write: Callable[[Path], None]) -> None:
    """Writes an export folder as one transaction (`jaxformer.files.write_folder_atomically`):
    a reader sees the previous export whole or the new one whole, and a write cut short
    leaves the previous one as it was.

    Args:
      export: the `--export` folder (checked by `check_export_dir`).
      write: fills the new folder it is given.

    On a run of several processes, process 0 writes it (from arrays every process holds
    whole: `jaxformer.sharding.to_host`).

    Raises:
      OSError: naming the path, when it cannot be written (a full disk, say).
    """
    if not is_primary():
        return
    export.absolute().parent.mkdir(parents=True, exist_ok=True)
    write_folder_atomically(export, write)
