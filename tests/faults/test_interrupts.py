"""The fault matrix, signals and pipes: how every command ends when its user stops it.

Ctrl-C ends a command with status 130 and one line on stderr (`prog: interrupted`, and
for a training run what it kept); a reader of standard output that goes away (`| head`,
`| true`) ends it with status 141 and nothing printed; a standard output closed from the
start is refused in one line. `jaxformer.command_line.run_command` is the one path; the
cases run the generation command as a user does, on a tiny random checkpoint whose
decoding is long enough to be interrupted, and the training loop in-process. (Ctrl-C in
a training run, with what it keeps and how it resumes, is in `test_runs.py`.)
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import CLI_TINY, REPO

from jaxformer import Decoder, DecoderConfig, command_line
from jaxformer.command_line import BROKEN_PIPE, INTERRUPTED, run_command
from jaxformer.convert import save_hf
from jaxformer.text import save_tokenizer, train_bpe
from jaxformer.training import TrainState, make_train_step, train_loop

GENERATE = "jaxformer-generate"
LONG = ["--prompt", "the cat", "--max-new-tokens", "6000"]  # seconds of decoding for the tiny model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random tiny decoder and a BPE tokenizer, with room for a long completion."""
    tokenizer = train_bpe(["the cat sat on the mat, and the dog sat on the log. " * 40], 300)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=1, d_model=32,
                           max_seq_len=8192)
    model = Decoder(config)
    params = jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"]
    path = str(tmp_path_factory.mktemp("checkpoint"))
    save_hf(config, params, path, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    save_tokenizer(tokenizer, path)
    return path


def start(argv: list[str], **popen) -> subprocess.Popen:
    """The generation command started as a user starts it, its output read by the test: a
    process of its own, as the signal, the pipe and the closed descriptor are a process's."""
    return subprocess.Popen([sys.executable, "-m", "jaxformer.commands.generate", *argv], cwd=REPO,
                            stdout=popen.pop("stdout", subprocess.PIPE), stderr=subprocess.PIPE, **popen)


def wait_for_input(process: subprocess.Popen, timeout: float = 120) -> None:
    """Waits until the command blocks reading its standard input: past Python's start-up
    (JAX's import), inside the command's own work."""
    deadline = time.monotonic() + timeout
    while not any(wait in Path(f"/proc/{process.pid}/wchan").read_text() for wait in ("pipe_read", "pipe_wait")):
        assert process.poll() is None and time.monotonic() < deadline, "the command never read its input"
        time.sleep(0.01)


def interrupt(process: subprocess.Popen) -> tuple[int, list[str]]:
    """Ctrl-C for a process still running; its status and stderr lines."""
    assert process.poll() is None, "the command ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    return process.returncode, err.decode().splitlines()


def test_ctrl_c_while_streaming_is_130_and_one_line(checkpoint):
    process = start(["--checkpoint", checkpoint, "--stream", *LONG])
    assert process.stdout.read(20)  # the completion is being printed
    status, err = interrupt(process)
    assert status == INTERRUPTED and err == [f"{GENERATE}: interrupted"], err


def test_ctrl_c_while_decoding_in_one_program_is_130_and_one_line(checkpoint):
    """Without --stream the completions come at the end: the signal comes during the
    loading, compiling or decoding, each of which must end the same way. (Prompts are
    read from standard input, so that the clock starts once the command runs its work.)"""
    process = start(["--checkpoint", checkpoint, "--prompts-file", "-", "--max-new-tokens", "6000"],
                    stdin=subprocess.PIPE)
    wait_for_input(process)
    process.stdin.write(b"the cat\nthe dog\n")
    process.stdin.close()
    process.stdin = None  # (for communicate: nothing more to send)
    time.sleep(0.5)
    status, err = interrupt(process)
    assert status == INTERRUPTED and err == [f"{GENERATE}: interrupted"], err


def test_ctrl_c_while_waiting_for_input_is_130_and_one_line(checkpoint):
    process = start(["--checkpoint", checkpoint, "--prompts-file", "-"], stdin=subprocess.PIPE)
    wait_for_input(process)
    status, err = interrupt(process)
    assert status == INTERRUPTED and err == [f"{GENERATE}: interrupted"], err


@pytest.mark.parametrize("argv, read", [(["--stream", *LONG], 10), ([*LONG[:2], "--max-new-tokens", "8"], 0),
                                        (["--json", *LONG[:2], "--max-new-tokens", "8"], 0)],
                         ids=["stream-head-c-10", "pipe-to-true", "json-pipe-to-true"])
def test_a_reader_that_goes_away_ends_it_quietly(checkpoint, argv, read):
    """`--stream | head -c 10` (the reader takes 10 bytes and leaves) and `| true` (it
    leaves before anything is written): status 141, as a process SIGPIPE ends, and not a
    word on stderr."""
    process = start(["--checkpoint", checkpoint, *argv])
    assert len(process.stdout.read(read)) == read
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == BROKEN_PIPE and err.decode() == "", err.decode()[-2000:]


def test_a_training_run_whose_reader_went_away_ends_quietly(tmp_path):
    """`python -m train.reverse | true`: the first write to stdout that reaches the pipe
    (at once when Python writes unbuffered, else at the end) finds no reader; the run
    ends there with status 141 rather than a traceback, leaving no half-started run: a
    new one that had saved nothing is undone, a finished one is kept."""
    process = subprocess.Popen([sys.executable, "-m", "train.reverse", "--steps", "5",
                                "--run-dir", str(tmp_path / "run"), *CLI_TINY], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    _, err = process.communicate(timeout=300)
    assert process.returncode == BROKEN_PIPE and "Traceback" not in err.decode(), err.decode()[-3000:]
    assert not (tmp_path / "run").exists() or (tmp_path / "run" / "eval.json").is_file()


@pytest.mark.parametrize("argv", [["--stream"], []], ids=["stream", "batch"])
def test_a_closed_standard_output_is_refused_in_one_line(checkpoint, argv):
    """`... >&-`: Python starts with `sys.stdout` None, where printing does nothing; the
    command says there is nowhere to write rather than printing nothing."""
    # The shell closes descriptor 1, then becomes the command.
    process = subprocess.Popen(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "jaxformer.commands.generate",
                                "--checkpoint", checkpoint, "--prompt", "the cat", "--max-new-tokens", "4", *argv],
                               cwd=REPO, stderr=subprocess.PIPE)
    _, err = process.communicate(timeout=120)
    lines = err.decode().splitlines()
    assert process.returncode == 2 and lines == [f"{GENERATE}: error: standard output is closed: there is "
                                                 "nowhere to write the completions"], lines


# ---------------------------------------------------------------------------------------
# An interrupt that something swallowed still ends the command

def swallow_ctrl_c() -> None:
    """Ctrl-C for this process, caught where it lands, as a callback from compiled code
    (XLA's, tensorstore's) may catch and drop it. Only under a Python handler, in the main
    thread: with none, the signal would end this process (a pytest-xdist worker)."""
    assert threading.current_thread() is threading.main_thread(), "the handler would run elsewhere"
    assert callable(signal.getsignal(signal.SIGINT)), "no Python handler for SIGINT: it would end this process"
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # (the handler runs at the next bytecode; this never ends)
    except KeyboardInterrupt:
        pass


def test_a_swallowed_interrupt_still_ends_the_command_with_130(capsys):
    handler = signal.getsignal(signal.SIGINT)
    assert run_command("prog", lambda: (swallow_ctrl_c(), 0)[1]) == INTERRUPTED
    assert capsys.readouterr().err == "prog: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is handler  # this process's own handler is back
    assert run_command("prog", lambda: 0) == 0  # and the next command starts afresh


def test_a_redelivered_interrupt_that_lands_after_the_command_is_not_raised_into_its_caller():
    """A swallowed Ctrl-C is sent again a moment later (`_interrupt_if_running`); when the
    command ends in that moment, the handler runs after it: it must not raise into the
    caller (a test session, a server), and the next command starts afresh."""
    assert run_command("prog", lambda: 0) == 0
    command_line._on_interrupt(signal.SIGINT, None)  # the late handler call
    command_line._interrupt_if_running()  # the timer, after the end: sends nothing
    time.sleep(0.05)  # (an interrupt sent would be raised here)
    assert run_command("prog", lambda: 0) == 0


def test_a_swallowed_interrupt_stops_the_training_loop_at_the_next_update(tmp_path, capsys):
    """Ctrl-C swallowed while update 7's batch is drawn: the loop draws no batch after
    it; the checkpoint of step 5 stays, and no later one is saved."""
    w = jnp.zeros(3)
    optimizer = optax.sgd(0.1)
    step = make_train_step(lambda p, batch, key: (jnp.sum((p - batch) ** 2), {}), optimizer)
    updates = []

    def make_batch(key):
        updates.append(len(updates) + 1)
        if len(updates) == 7:
            swallow_ctrl_c()
        return jax.random.normal(key, (3,))

    def work():
        train_loop(TrainState.create(w, optimizer), step, make_batch, seed=0, num_steps=50, run_dir=tmp_path,
                   checkpoint_every=5, log_every=1, progress=False)
        return 0

    handler = signal.getsignal(signal.SIGINT)
    assert run_command("prog", work) == INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is handler
    assert updates == list(range(1, 8))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5"]
    assert capsys.readouterr().err == "prog: interrupted\n"
