"""The experts' real size: an OLMoE-1B-7B-shaped checkpoint (random bfloat16 weights made here:
6.92 B parameters, 1.28 B active a token, 13.8 GB) decoded by `jaxformer-generate` in a fresh
process whose peak resident memory is measured. In the full tier (`pytest -m full`): a few
minutes, 14 GB of disk and about 15 GB of memory."""

import json

import pytest
from test_real_size import GB, run_measured

from benchmarks import olmoe_7b

pytestmark = pytest.mark.full

PARAMETERS, ACTIVE = olmoe_7b.parameters(olmoe_7b.CONFIG)
CACHE = 16 * 2 * 256 * 16 * 128 * 2  # bytes: layers x (k, v) x 256 positions x 16 heads x 128 channels, bfloat16


def test_olmoe_shaped_experts_decode_within_their_weights_and_cache(tmp_path):
    """bf16 weights (13.8 GB) and a 256-position cache: the peak is within 1.3x; the decode
    step reads the 8 chosen experts of each layer, never a float32 copy of all 64."""
    assert (PARAMETERS, ACTIVE) == (6_919_161_856, 1_282_017_280)
    checkpoint = olmoe_7b.write(str(tmp_path / "olmoe"))
    done, peak = run_measured("jaxformer.commands.generate", "--checkpoint", checkpoint, "--prompt", "The cat sat on",
                              "--max-new-tokens", "8", "--max-seq-len", "256", "--dtype", "bfloat16", "--json")
    assert json.loads(done.stdout.splitlines()[-1])["completion_tokens"] == 8
    assert peak <= 1.3 * (2 * PARAMETERS + CACHE), f"{peak / GB:.2f} GB"
