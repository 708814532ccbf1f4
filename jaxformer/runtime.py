"""Process-wide setup a command does first: joining the other processes of a run (JAX's
multi-controller runtime, `jax.distributed`), and keeping compiled programs on disk; then
what processes of one run agree on: who writes the run's files, and whether a check passed.

Every process of a run runs the same command. They compute together (each step is one
program over every process's devices), but the run directory is written by one of them,
process 0 (`is_primary`); a check that only process 0 can make (the run directory's lock)
is shared with the others (`on_primary`), so that they all go on or all stop, never one
stopping while the others wait for it in a collective.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import jax
import numpy as np

from jaxformer.command_line import FAILED, leave_at_once_on_failure
from jaxformer.validation import as_int

T = TypeVar("T")

JOIN_TIMEOUT_VARIABLE = "JAXFORMER_JOIN_TIMEOUT"
JOIN_SECONDS = 120  # default: how long a process waits for the others to start and join
HEARTBEAT_SECONDS = 30  # a process that stops answering (it died) ends the others within this long
SHUTDOWN_SECONDS = 60  # at exit, how long a process waits for the others to finish too
LINGER_SECONDS = 2.0  # how long a failing process 0 waits before it leaves (and so ends the others)
_MESSAGE_BYTES = 2048  # of a shared error line


def distributed_settings(environ=os.environ) -> dict | None:
    """What `jax.distributed.initialize` is given, read from the environment: None on one
    host; `{}` where JAX reads a cluster's variables itself (Slurm, Open MPI, a TPU pod
    slice); else the `JAX_*` variables, checked.

    Raises:
      ValueError: in one line naming the variable: `JAX_NUM_PROCESSES` without a
        coordinator or without `JAX_PROCESS_ID`, an id outside `[0, JAX_NUM_PROCESSES)`, a
        count below 1, an address without a port.
    """
    named = [name for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if name in environ]
    cluster = (int(environ.get("SLURM_NTASKS", "1")) > 1 or "OMPI_MCA_orte_hnp_uri" in environ
               or "," in environ.get("TPU_WORKER_HOSTNAMES", ""))
    if not named:
        return {} if cluster else None
    if "JAX_NUM_PROCESSES" not in environ:
        if "JAX_PROCESS_ID" in environ or not cluster:
            raise ValueError(f"{' and '.join(named)} set but JAX_NUM_PROCESSES is not: set it (with "
                             "JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID) on every process")
        return {"coordinator_address": _address(environ["JAX_COORDINATOR_ADDRESS"])}  # the rest from the cluster
    count = _int_variable(environ, "JAX_NUM_PROCESSES", 1)
    if "JAX_COORDINATOR_ADDRESS" not in environ:
        raise ValueError(f"JAX_NUM_PROCESSES={count} but JAX_COORDINATOR_ADDRESS is not set: set it to process "
                         "0's host:port on every process")
    if "JAX_PROCESS_ID" not in environ:
        raise ValueError(f"JAX_NUM_PROCESSES={count} but JAX_PROCESS_ID is not set: give each process its own id, "
                         f"0 to {count - 1}")
    process_id = _int_variable(environ, "JAX_PROCESS_ID", 0)
    if process_id >= count:
        raise ValueError(f"JAX_PROCESS_ID={process_id} is not below JAX_NUM_PROCESSES={count}: the ids are 0 to "
                         f"{count - 1}")
    return {"coordinator_address": _address(environ["JAX_COORDINATOR_ADDRESS"]), "num_processes": count,
            "process_id": process_id}


def _int_variable(environ, name: str, minimum: int) -> int:
    text = environ[name].strip()
    if not text.isdigit() or int(text) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (got {environ[name]!r})")
    return int(text)


def _address(text: str) -> str:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS must be host:port, process 0's (got {text!r})")
    return text.strip()


def join_timeout(environ=os.environ) -> int:
    """Seconds a process waits for the others to join: `$JAXFORMER_JOIN_TIMEOUT`, else `JOIN_SECONDS`."""
    if JOIN_TIMEOUT_VARIABLE not in environ:
        return JOIN_SECONDS
    return _int_variable(environ, JOIN_TIMEOUT_VARIABLE, 1)


def initialize_distributed(prog: str = "jaxformer") -> bool:
    """Joins the other processes of a run when the environment names some (docs/sharding.md,
    "Several hosts"); call it before anything touches a device.

    Every way of failing to join ends in one line within `join_timeout()` seconds, not in a
    hang: a process whose coordinator does not answer, a process 0 whose port is taken (by
    another process 0), or a join the other processes never complete (one missing, or two
    with one id), which ends the waiting process (`prog: error: ...`, status 1). Once joined,
    a process that dies ends the others within `HEARTBEAT_SECONDS` (JAX's own message), and
    a command that fails ends its process at once (`leave_at_once_on_failure`), so that the
    others learn of it.

    Args:
      prog: the command, for the line of a join that does not complete.

    Returns:
      Whether it joined others (False on a single host).

    Raises:
      ValueError: in one line, naming the variable or the address (see `distributed_settings`).
    """
    settings = distributed_settings()
    if settings is None:
        return False
    timeout = join_timeout()
    if "process_id" in settings:  # the JAX_* variables: checked here, where a failure can be said in one line
        _check_coordinator(settings["coordinator_address"], settings["process_id"], timeout)
    why = (f"the run's {settings.get('num_processes', 'other')} processes did not all join within {timeout} s "
           f"({JOIN_TIMEOUT_VARIABLE}): one is missing, or two have the same JAX_PROCESS_ID")
    with _deadline(timeout, f"{prog}: error: {why}"):
        # JAX's own deadline comes later: its failure is a crash with a stack trace, ours is a line.
        jax.distributed.initialize(**settings, initialization_timeout=timeout + 30,
                                   heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
                                   shutdown_timeout_seconds=SHUTDOWN_SECONDS)
    # JAX's runtime catches SIGTERM to note a preemption and goes on; a jaxformer command ends
    # on it, as on one host (and `timeout` and `kill` expect), and the others follow it.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Process 0's end stops the others at once: failing with it, they first get to say why.
    leave_at_once_on_failure(LINGER_SECONDS if jax.process_index() == 0 else 0.0)
    return True


def _check_coordinator(address: str, process_id: int, timeout: int) -> None:
    """Process 0 serves the coordinator on the address's port: it must be free. Every other
    process waits, up to `timeout` seconds, until it answers."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind(("", int(port)))
            except OSError as e:
                raise ValueError(f"JAX_COORDINATOR_ADDRESS {address}: process 0 serves the coordinator on port {port}, "
                                 f"which is in use on this host ({e.strerror}): another process 0 of this run (two "
                                 "with one JAX_PROCESS_ID), or another program; choose a free port") from None
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator at JAX_COORDINATOR_ADDRESS {address} within "
                                 f"{timeout} s ({e.strerror or e}): start process 0 there, or check the address and "
                                 "that the port is open") from None
            time.sleep(0.5)


@contextlib.contextmanager
def _deadline(seconds: float, line: str):
    """Ends the process with `line` on stderr (status 1) unless the block is done within
    `seconds`: for a call that cannot be interrupted from Python."""
    def expire():
        with contextlib.suppress(OSError, ValueError):
            print(line, file=sys.stderr, flush=True)
            sys.stdout.flush()
        os._exit(FAILED)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def is_primary() -> bool:
    """Whether this process writes the run's files: process 0 (the only one on one host)."""
    return jax.process_index() == 0


def on_primary(work: Callable[[], T]) -> T | None:
    """`work()` on process 0 alone; every process raises the `ValueError` it raised.

    A collective: every process of the run calls it at the same point. On one process it is
    `work()`.

    Returns:
      `work()`'s result on process 0; None on the others.
    """
    if jax.process_count() == 1:
        return work()
    result, message = None, ""
    if is_primary():
        try:
            result = work()
        except ValueError as e:
            message = str(e)
    message = _share_text(message)
    if message:
        raise ValueError(message)
    return result


def agree(ok: bool, message: str) -> None:
    """Raises `ValueError(message)` on every process unless `ok` holds on every process
    (with the processes where it does not). A collective, as `on_primary`."""
    if jax.process_count() == 1:
        if not ok:
            raise ValueError(message)
        return
    from jax.experimental import multihost_utils

    oks = np.asarray(multihost_utils.process_allgather(np.array([ok], np.int32)))
    failing = [i for i, value in enumerate(oks.reshape(-1)) if not value]
    if failing:
        raise ValueError(f"{message} (on process{'es' if len(failing) > 1 else ''} "
                         f"{', '.join(map(str, failing))})")


def barrier(name: str) -> None:
    """Waits until every process of the run reaches the barrier `name` (nothing on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _share_text(text: str) -> str:
    """Process 0's `text` on every process (cut to `_MESSAGE_BYTES` bytes)."""
    from jax.experimental import multihost_utils

    data = np.zeros(_MESSAGE_BYTES, np.uint8)
    encoded = text.encode("utf-8")[:_MESSAGE_BYTES]
    data[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return bytes(shared).rstrip(b"\0").decode("utf-8", errors="replace")


def local_environments(count: int, devices: int, environ=os.environ) -> list[dict[str, str]]:
    """The environments of `count` processes of one run on this machine, joined over loopback,
    each seeing `devices` CPU devices: to try a run of several processes without several
    hosts (docs/sharding.md, "Several hosts"). One process (`count` 1) names no others.

    Returns:
      For each process id, `environ` with `JAX_COORDINATOR_ADDRESS` (a free loopback port),
      `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, `JAX_PLATFORMS=cpu` and the device count in
      `XLA_FLAGS`.
    """
    count, devices = as_int(count, "count", minimum=1), as_int(devices, "devices", minimum=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {name: value for name, value in environ.items()
            if name not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    base.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{environ.get('XLA_FLAGS', '')} "
                                               f"--xla_force_host_platform_device_count={devices}".strip())
    if count == 1:
        return [base]
    return [{**base, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(count),
             "JAX_PROCESS_ID": str(i)} for i in range(count)]


def enable_compilation_cache(directory=None) -> Path:
    """Keeps compiled XLA programs on disk, so a second run skips compilation.

    Args:
      directory: where; defaults to `$JAXFORMER_CACHE_DIR`, else `~/.cache/jaxformer/xla`.

    Returns:
      The directory used.
    """
    directory = Path(directory or os.environ.get("JAXFORMER_CACHE_DIR") or Path.home() / ".cache" / "jaxformer" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache every program that took noticeable time to compile, however small its binary.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
