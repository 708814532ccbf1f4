"""`python -m benchmarks.moe_steps` on a tiny mixture of experts (no timing asserted): both
sides prefill and take a LoRA step on the same ids, their first losses agree, and the ratios
are reported."""

import json

import pytest
from conftest import import_peer

from benchmarks import moe_steps

pytestmark = pytest.mark.peers


def test_both_sides_prefill_and_step_from_the_same_loss(tmp_path, capsys):
    import_peer("peft")
    out = tmp_path / "steps.json"
    moe_steps.main(["--d-model", "256", "--layers", "1", "--experts", "8", "--width", "64", "--top-k", "2",
                    "--vocab", "1024", "--seq-len", "32", "--steps", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["prefill_ratio"] > 0 and result["lora_step_ratio"] > 0
    np_first = result["first_losses"]
    assert abs(np_first[0] - np_first[1]) <= 1e-4 * abs(np_first[1])
    assert "LoRA step 1 x 32" in capsys.readouterr().out
