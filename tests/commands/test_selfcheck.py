import pytest
from conftest import run_main

from jaxformer.commands import selfcheck


@pytest.mark.parametrize("check", selfcheck.CHECKS, ids=lambda c: c.__name__)
def test_reference_check_passes(check):
    result = check()
    assert result.passed, f"{result.name}: {result.figure}"


def test_cli_prints_every_figure_and_exits_zero():
    """`jaxformer-selfcheck`, run in this process (its programs compiled once,
    by the checks above)."""
    done = run_main(lambda argv: selfcheck.main(), [])
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.rstrip().endswith("OK")]
    assert len(lines) == len(selfcheck.CHECKS)
    assert "past delta 0.00e+00" in done.stdout
    assert f"{len(selfcheck.CHECKS)} passed, 0 failed" in done.stdout


def test_main_fails_when_a_check_fails(monkeypatch, capsys):
    failing = lambda: selfcheck.CheckResult("broken", False, "figure 1.0")  # noqa: E731
    monkeypatch.setattr(selfcheck, "CHECKS", (selfcheck.check_rmsnorm, failing))
    assert selfcheck.main() == 1
    out = capsys.readouterr().out
    assert "broken:" in out and "FAILED" in out and "1 passed, 1 failed" in out
