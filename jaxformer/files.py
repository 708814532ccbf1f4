"""Files a user keeps: written so that a crash leaves the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(path, write: Callable[[Path], None]) -> None:
    """Writes `path` through `write(tmp)`, then renames `tmp` over `path`.

    `tmp` sits in the same directory (a rename within one filesystem is atomic) and is
    flushed to disk before the rename, so a reader sees the old file or the whole new
    one. If `write` raises, `tmp` is removed and `path` is untouched.

    Args:
      path: the file to create or replace; its directory must exist.
      write: writes the new content to the path it is given.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:  # what `write` left may sit in the page cache only
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomically(path, text: str) -> None:
    """`write_atomically` for a text file (UTF-8)."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
