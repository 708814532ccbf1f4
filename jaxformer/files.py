"""Files and folders a user keeps: written so that a crash leaves the old one or the new
one, never a part, with the permissions `open()` would give them."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

# What a folder's temporary twin is called while `write_folder_atomically` fills it.
FOLDER_TMP_INFIX = ".jaxformer-tmp-"


def umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def _mode_for(path: Path, new_mode: int) -> int:
    """The mode `open()` leaves: an existing file keeps its own; a new one gets
    `new_mode` less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return new_mode & ~umask()


def check_apart(outputs: dict[str, object], inputs: dict[str, object]) -> None:
    """Raises ValueError unless every output path lies apart from every input path: an
    output that is an input, holds one or lies inside one would overwrite, undo or mix into
    what the command reads. Paths are compared resolved (symlinks followed, `..` applied),
    so another spelling of the same place is caught too.

    Args:
      outputs: `{name: path}` of what a command writes, e.g. `{"--merge": "out"}`; None
        entries are skipped.
      inputs: `{name: path}` of what it reads, e.g. `{"--checkpoint": "base"}`.
    """
    def resolved(path) -> Path:
        return Path(os.path.realpath(os.path.abspath(path)))

    for out_name, out in outputs.items():
        if out is None:
            continue
        out_path = resolved(out)
        for in_name, given in inputs.items():
            if given is None:
                continue
            in_path = resolved(given)
            if out_path == in_path:
                relation = "is the same place as"
            elif in_path.is_relative_to(out_path):
                relation = "holds"
            elif out_path.is_relative_to(in_path):
                relation = "lies inside"
            else:
                continue
            raise ValueError(f"{out_name} {out} {relation} {in_name} {given}: writing there could overwrite what "
                             f"the command reads; choose a {out_name} apart from {in_name}")


def read_text(path, name: str) -> str:
    """The text of the UTF-8 file `path`, or a ValueError naming `name` (the flag that gave
    it): a file that cannot be read (and why), or bytes that are not UTF-8 (where)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {name} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start:,})") from None


def read_json_object(path, what: str = "a JSON object") -> dict:
    """The JSON object in the file `path`, or a ValueError naming the file: unreadable, not
    JSON (or nested too deeply to parse), or JSON of another kind than `what` describes."""
    try:
        value = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON here: it nests too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not {what}")
    return value


def write_atomically(path, write: Callable[[Path], None]) -> None:
    """Writes `path` through `write(tmp)`, then renames `tmp` over `path`.

    `tmp` sits in the same directory, where a rename is atomic, and is flushed first, so a
    reader sees the old file or the whole new one; it gets the mode `open()` would give.

    Args:
      path: the file to create or replace; its directory must exist.
      write: writes the new content to the path it is given.

    Raises:
      OSError: `write`'s own, naming `path` (`tmp` removed, `path` untouched).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(fd)
        write(Path(tmp))  # (which may replace the file mkstemp made by one of its own)
        os.chmod(tmp, _mode_for(path, 0o666))
        with open(tmp, "rb") as f:  # what `write` left may sit in the page cache only
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def write_text_atomically(path, text: str) -> None:
    """`write_atomically` for a text file (UTF-8)."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def append_line(path, line: str) -> None:
    """Appends `line` and a newline to `path` (created if missing), whole or not at all: a
    write that fails part-way is cut back off, and its `OSError` names `path`.
    """
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # new: 0o666 less the umask
    try:
        end = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def write_folder_atomically(path, write: Callable[[Path], None]) -> None:
    """Writes the folder `path` through `write(tmp)`, then swaps `tmp` in for it whole.

    `tmp` (`.<name>.jaxformer-tmp-XXXX`, beside `path`) is flushed, then exchanged with
    `path` in one step (Linux's `renameat2`; elsewhere two renames, an instant with
    neither). If `write` raises, `path` is untouched. A killed writer's twin is removed by
    the next call; a twin another process holds locked is left alone.

    Args:
      path: the folder to create or replace; its parent must exist.
      write: fills the new folder it is given (which exists and is empty).
    """
    path = Path(path).absolute()
    _remove_stale_twins(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}{FOLDER_TMP_INFIX}"))
    try:
        with _locked(tmp):
            os.chmod(tmp, _mode_for(path, 0o777))
            write(tmp)
            _sync_tree(tmp)
            if path.exists():
                _exchange(tmp, path)  # tmp now names the old folder
            else:
                os.rename(tmp, path)
            _sync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_folder_twin(name: str, folder_name: str) -> bool:
    """Whether `name` is a temporary twin `write_folder_atomically` makes for `folder_name`."""
    return name.startswith(f".{folder_name}{FOLDER_TMP_INFIX}")


def _remove_stale_twins(path: Path) -> None:
    """Removes the twins of `path` that no live process is writing (their lock is free)."""
    for twin in path.parent.iterdir():
        if is_folder_twin(twin.name, path.name) and twin.is_dir():
            with contextlib.suppress(BlockingIOError, OSError), _locked(twin):
                shutil.rmtree(twin)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Holds an exclusive lock on `folder` (BlockingIOError if another process holds it)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """Flushes every file under `folder`, and the folders themselves, to disk."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _sync_dir(Path(root))


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Swaps the names `a` and `b` atomically where the system can; else in two renames."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # a real failure, not a missing feature
            raise OSError(code, os.strerror(code), str(b))
    aside = a.with_name(a.name + ".old")
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)
