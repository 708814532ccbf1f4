"""What every jaxformer command line shares: one way to end (`run_command`), errors as
one line, help texts that state their defaults, and the flags of a model quantized as it
is read (`add_quantize_flags`).

The exit statuses, and what each prints, are tabled in docs/training.md ("How a run
ends"). SIGTERM keeps Python's default: the process ends at once, as `kill` expects.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, NoReturn

import jax

from jaxformer.config import DecoderConfig
from jaxformer.decoder import Decoder
from jaxformer.quantized import FORMATS, GROUPS, QArray, Quantization, format_of, quantize_params, stored_bytes
from jaxformer.sharding import param_axes

FAILED, REFUSED, INTERRUPTED, BROKEN_PIPE = 1, 2, 128 + signal.SIGINT, 128 + signal.SIGPIPE

_interrupted = threading.Event()
_running = threading.Event()  # a command's work is under way (`run_command`)
_running_lock = threading.Lock()  # a redelivered Ctrl-C (`_interrupt_if_running`) never lands after the command
_deferring = [0]  # how many `interrupts_deferred` blocks are open
_interrupt_note: list[Callable[[], str]] = []  # what the interrupted line adds, set by the command
_leave_at_once: list[bool | float] = [False]  # False, or the seconds a failing process lingers before it leaves


def fail(prog: str, message: str, status: int = REFUSED) -> NoReturn:
    """Stops a command with one line on stderr, `prog: error: message`, and exit `status`:
    `REFUSED` (2) for input the command will not take, `FAILED` (1) for work it could not do.
    """
    _say(f"{prog}: error: {message}")
    if _leave_at_once[0] is not False:
        _leave(status)
    sys.exit(status)


def leave_at_once_on_failure(linger: float = 0.0) -> None:
    """From now on a failing command (`fail`, a non-zero `exit_process`, an uncaught
    exception after its traceback) ends its process without the interpreter's teardown,
    its output flushed: for a process of a run of several
    (`jaxformer.runtime.initialize_distributed`), whose teardown would wait for the
    others to finish while they wait for it in their next collective. Its end is what tells
    them: they stop within JAX's heartbeat timeout.

    Args:
      linger: seconds to wait first: for the process whose end stops the others at once
        (JAX's coordinator, process 0), so that those failing with it say why themselves.
    """
    _leave_at_once[0] = linger
    excepthook = sys.excepthook

    def report_then_leave(kind, error, traceback):
        excepthook(kind, error, traceback)
        _leave(FAILED)

    sys.excepthook = report_then_leave


def _leave(status: int) -> NoReturn:
    """Ends the process with `status`, its output flushed, without the teardown (a failing
    process of a run of several lingers first, `leave_at_once_on_failure`)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        _flush(sys.stdout)
        _flush(sys.stderr)
    if _leave_at_once[0]:
        time.sleep(_leave_at_once[0])
    os._exit(status)


def note_on_interrupt(note: Callable[[], str] | None) -> None:
    """Sets what Ctrl-C's line adds to "interrupted" (say, how to resume), computed when it
    comes; None adds nothing."""
    _interrupt_note[:] = [] if note is None else [note]


def interrupted() -> bool:
    """Whether Ctrl-C came during this command, even if a callback from compiled code (XLA,
    tensorstore) caught and lost the `KeyboardInterrupt`; long loops ask between steps.
    """
    return _interrupted.is_set()


def raise_if_interrupted() -> None:
    """Raises `KeyboardInterrupt` if Ctrl-C came during this command (see `interrupted`)."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block is noted, not raised, so the block (a checkpoint's start,
    which an interrupt would leave torn) runs to its end; the next `raise_if_interrupted`
    raises it."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1


# glibc's malloc (mallopt's parameters, malloc.h): a block of M_MMAP_THRESHOLD bytes or more gets a mapping
# of its own, unmapped when freed; the heap's free top past M_TRIM_THRESHOLD goes back to the system.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


@contextlib.contextmanager
def loading_memory() -> Iterator[None]:
    """Around a command's `load_hf`: while it reads, every block of 1 MiB or more is mapped on its own
    and given back once freed. By default glibc keeps freed blocks below a threshold that grows (to
    32 MiB) for reuse, and loading frees a float copy of each tensor among the quantized matrices it
    keeps: the process went on holding ~0.2 GB of them (the 1B shape quantized to int8 on load peaked
    at 2.66 GiB against 2.46; tests/test_real_size.py). Afterwards, the thresholds that growth reaches
    (32 MiB, and twice that for the heap's top): a lower one stays would map and unmap a product's
    blocks at every step (products by blocks ran at half speed). Elsewhere than glibc, nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        libc = None
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
            libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


def run_command(prog: str, work: Callable[[], int]) -> int:
    """Runs a command's `work()` and returns its exit status: the one way commands end.

    Ctrl-C: 130 and `prog: interrupted` (plus the `note_on_interrupt` text). A closed
    standard output (`BrokenPipeError`): 141, quietly. An uncaught `OSError` (a full
    disk): 1 and one line naming the path. `SystemExit` (`fail`, `--help`) passes through.

    Args:
      prog: the command, for its lines.
      work: the command's body; returns its exit status.
    """
    on_main_thread = threading.current_thread() is threading.main_thread()
    _interrupted.clear()  # (a Ctrl-C noted after the last command ended is not this one's)
    _running.set()
    previous = signal.signal(signal.SIGINT, _on_interrupt) if on_main_thread else None
    unraisable = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver_interrupt, unraisable)
    try:
        status = work()
        _flush(sys.stdout)
        raise_if_interrupted()  # one that was swallowed on the way
        return status
    except KeyboardInterrupt:
        note = _interrupt_note[0]() if _interrupt_note else ""
        _say(f"{prog}: interrupted" + (f"; {note}" if note else ""))
        return INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except OSError as e:
        _say(f"{prog}: error: {describe_os_error(e)}")
        return FAILED
    finally:
        # First: from here a redelivery is dropped, and one already sent meets `_on_interrupt`,
        # which outside a command only notes it (cleared below), instead of raising into the caller.
        with _running_lock:
            _running.clear()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = unraisable
        _interrupted.clear()
        note_on_interrupt(None)


def exit_process(status: int) -> NoReturn:
    """Ends a command's process with `status`: its `__main__`'s last call, `exit_process(main())`.

    After Ctrl-C the device may still be running a program the command no longer waits for
    (a whole decoding loop is one program). The interpreter's teardown would then free what
    that program reads while it runs, and the process could die of SIGSEGV instead of
    exiting 130; so an interrupted command leaves at once, its output flushed, without the
    teardown; so does one whose reader went away (141: a teardown beside the runtime's threads
    could abort instead), and any failure of a process of a run of several (`leave_at_once_on_failure`).
    Any other status exits as `sys.exit` does.
    """
    if status in (INTERRUPTED, BROKEN_PIPE) or (status and _leave_at_once[0] is not False):
        _leave(status)
    sys.exit(status)


def describe_os_error(error: OSError) -> str:
    """An `OSError` as one line: what failed, and on which path."""
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror or error}"


def _on_interrupt(signum, frame) -> None:
    _interrupted.set()
    if _running.is_set() and not _deferring[0]:
        raise KeyboardInterrupt


def _interrupt_if_running() -> None:
    """Ctrl-C again for the main thread, unless the command has ended meanwhile."""
    with _running_lock:
        if _running.is_set():
            _thread.interrupt_main()


def _redeliver_interrupt(hook, unraisable) -> None:
    """Delivers an unraisable `KeyboardInterrupt` (Ctrl-C in a `gc` callback, which Python
    would print and ignore) to the main thread again, a moment later; passes on the rest."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        threading.Timer(0.01, _interrupt_if_running).start()
        return
    hook(unraisable)


def _say(line: str) -> None:
    """One line on stderr, unless stderr is gone too."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=sys.stderr, flush=True)


def _flush(stream) -> None:
    if stream is not None:
        stream.flush()


def _silence_stdout() -> None:
    """Points standard output at /dev/null, so the interpreter's last flush into the closed
    pipe prints no traceback."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help states it or X is None or off."""

    def _get_help_string(self, action):
        help = action.help or ""
        unsaid = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default:" in help or unsaid or not action.option_strings:
            return help
        return f"{help} (default: %(default)s)".lstrip()


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`prog: error: ...`), not a usage dump."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=prog, description=description, formatter_class=DefaultsFormatter)

    def error(self, message) -> NoReturn:
        fail(self.prog, message)


def add_quantize_flags(parser: argparse.ArgumentParser) -> None:
    """`--quantize`, `--quantize-group` and `--quantize-affine`: the model's matrices quantized as
    they are read (`load_hf(quantize=...)`); `quantization` turns them into a `Quantization`."""
    parser.add_argument("--quantize", choices=FORMATS, default=None,
                        help="hold attention's and the feed-forwards' matrices quantized, each as it is read "
                             "(the embedding, head and norms stay as stored): int8, one scale per output channel; "
                             "int4 or nf4, one per --quantize-group inputs (docs/precision.md); default: as stored")
    parser.add_argument("--quantize-group", type=int, choices=GROUPS, default=None,
                        help=f"with --quantize int4 or nf4: the inputs that share a scale (default: "
                             f"{Quantization.group})")
    parser.add_argument("--quantize-affine", action="store_true",
                        help="with --quantize int4: a zero point per group, its range from min to max, instead "
                             "of a symmetric one")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantize: the embedding and the output head too (a tied one once), a scale "
                             "per vocabulary row")


def quantization(flags) -> Quantization | None:
    """The `Quantization` that `add_quantize_flags`' flags ask for, or None without --quantize.

    Args:
      flags: the parsed flags, or any object with `quantize`, `quantize_group` and `quantize_affine`
        (a command's settings).

    Raises:
      ValueError: naming the flag, for a combination that means nothing: --quantize-group or
        --quantize-affine without --quantize, a group for int8 (one scale per channel), an affine nf4.
    """
    if flags.quantize is None:
        for flag, given in (("--quantize-group", flags.quantize_group is not None),
                            ("--quantize-affine", flags.quantize_affine),
                            ("--quantize-head", flags.quantize_head)):
            if given:
                raise ValueError(f"{flag} needs --quantize")
        return None
    if flags.quantize == "int8" and flags.quantize_group is not None:
        raise ValueError("--quantize-group does not go with --quantize int8, which has one scale per output channel "
                         "(int4 and nf4 have one per group)")
    if flags.quantize_affine and flags.quantize != "int4":
        raise ValueError(f"--quantize-affine goes with --quantize int4 alone, not {flags.quantize}")
    group = Quantization.group if flags.quantize_group is None else flags.quantize_group
    return Quantization(flags.quantize, group, flags.quantize_affine, flags.quantize_head)


def quantized_formats(params) -> str:
    """The formats of a parameter tree's quantized matrices (`quantized.format_of`), as the line
    that says what a command loaded names them: "int8 matrices", "fp8, int8 matrices" (a
    checkpoint's as shipped, and --quantize's), "int8 matrices, embedding and head" (--quantize-head),
    or "" where none is quantized."""
    formats = {format_of(x) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
               if isinstance(x, QArray)}
    head = ", embedding and head" if isinstance(params.get("embed"), QArray) else ""
    return f"{', '.join(sorted(formats))} matrices{head}" if formats else ""


def check_quantization(config: DecoderConfig, how: Quantization | None) -> int | None:
    """Refuses, from config.json alone, a --quantize-group that does not tile one of the model's
    matrices: the rule `quantize_params` applies, run on the parameters' shapes (`jax.eval_shape`:
    nothing computed), before a weight is read.

    Returns:
      The bytes the quantized parameters take (`quantized.stored_bytes`: an int4 value half a
      byte, as XLA packs them on a CPU too); None without `how`.

    Raises:
      ValueError: naming --quantize-group, the matrix's inputs and the groups that fit.
    """
    if how is None:
        return None
    model = Decoder(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *model.init_inputs())["params"])
    try:
        quantized = jax.eval_shape(lambda params: quantize_params(params, param_axes(model), how), shapes)
    except ValueError as e:  # `quantized.check_group`'s "group_size: 128 does not divide the matrix's inputs ..."
        raise ValueError("--quantize-group" + str(e).removeprefix("group_size:")) from None
    return stored_bytes(quantized)
