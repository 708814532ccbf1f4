"""Each family's tiny model gives the numbers recorded in goldens.npz (`goldens.py` says what
they are): bitwise, where the compiler and CPU are those that recorded them (goldens.json);
elsewhere within float32's error in another summation order.

A change to how the decoder is assembled (its layer kinds, the scan over runs of layers, the
groups of rows) moves no number; a change meant to move them rewrites the file
(`python tests/families/goldens.py`) and says why.
"""

import json

import numpy as np
import pytest
from goldens import FAMILIES, FILE, FINGERPRINT, fingerprint, numbers

# Another CPU's vector width sums each product's terms in another order. The bound is the one
# the families keep against transformers' float32 forward (tests/families/test_families.py),
# which sums in its own order; losses, a mean of such logits' log-softmax, the same relative.
FLOAT32_ORDER = 1e-4


@pytest.fixture(scope="module")
def recorded():
    with np.load(FILE) as saved:
        return {key: saved[key] for key in saved.files}


def same_machine() -> bool:
    return json.loads(FINGERPRINT.read_text()) == fingerprint()


# The fast tier keeps the plainest family; the full tier every family (Gemma 3's six layers of two
# specs, local RoPE, q/k norms and sandwich norms take twice Llama's time to compile).
FAST = ("Llama-3.2-1B",)


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.full) for f in FAMILIES])
def test_the_family_gives_the_recorded_numbers(family, recorded):
    got = numbers(family)
    assert sorted(got) == sorted(k for k in recorded if k.startswith(f"{family}/"))
    for key, value in got.items():
        want = recorded[key]
        assert value.dtype == want.dtype and value.shape == want.shape, key
        if same_machine():
            np.testing.assert_array_equal(value, want, err_msg=key)  # bitwise (NaN nowhere: equal means equal)
        elif key.endswith("greedy"):
            np.testing.assert_array_equal(value, want, err_msg=key)  # weights far from ties: no token turns
        elif "bfloat16" not in key:  # (bfloat16 rounds each layer's output: another order can move an ulp of it)
            np.testing.assert_allclose(value, want, atol=FLOAT32_ORDER * max(1.0, np.abs(want).max()), rtol=0,
                                       err_msg=key)
