"""`jaxformer-serve`'s flags: each bad one refused in one line, before anything loads.
(The server itself, started for real: tests/serving/test_app.py.)"""

import re

import pytest
from conftest import run_main

from jaxformer.commands import serve


@pytest.mark.parametrize("flags, message", [
    (["--prefill-chunk", "12"], r"--prefill-chunk must be a power of two \(got 12\)"),
    (["--max-batch", "0"], r"--max-batch must be a positive int \(got 0\)"),
    (["--max-queue", "-1"], r"--max-queue must be an int >= 0 \(got -1\)"),
    (["--port", "70000"], r"--port must be an int in \[0, 65535\] \(got 70000\)"),
    (["--dtype", "float16"], r"--dtype must be one of float32, bfloat16 \(got 'float16'\)"),
    (["--max-seq-len", "1"], r"--max-seq-len must be an int >= 2 \(got 1\)"),
    (["--api-key", ""], r"--api-key must not be empty"),
])
def test_bad_flags_are_refused_in_one_line(tmp_path, flags, message):
    result = run_main(serve.main, ["--checkpoint", str(tmp_path), *flags])
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("jaxformer-serve: error: ")
    assert re.search(message, line), line


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    result = run_main(serve.main, ["--checkpoint", str(tmp_path / "missing")])
    assert result.returncode == 2
    missing = tmp_path / "missing"
    assert result.stderr == f"jaxformer-serve: error: {missing}: no such checkpoint folder\n"
