"""benchmarks.cache_bytes: the caches' bytes from their shapes, what the lines say."""

import re

from benchmarks import cache_bytes


def test_the_latent_cache_is_its_layers_latent_and_rope_key_and_a_hybrids_states_do_not_grow(capsys):
    """DeepSeek-V3's latent cache keeps 512 + 64 numbers a token and layer against 128 heads of 192 + 128:
    71.1x at any context; Qwen3.5-9B's states are one size at any context, so its hybrid cache is
    further below every layer full the longer the context."""
    ratios = {}
    for context in (2048, 8192):  # (the caches of both contexts' shapes fit a loaded machine's free memory)
        cache_bytes.main(["--context", str(context)])
        out = capsys.readouterr().out
        assert "latent 1,152 B a token and layer (576 numbers), heads expanded 81,920 B (40,960): 71.1x" in out
        states = re.search(r"(\d+\.\d) MB a row at any length", out).group(1)
        ratios[context] = float(re.search(r"every layer full 4,096 B: (\d+\.\d)x", out).group(1))
        assert states == "51.5"  # 24 x (3 x 8192 conv inputs in bfloat16 + 32 x 128 x 128 float32)
    assert 1 < ratios[2048] < ratios[8192] < 4  # (8 of 32 layers full: at most 4x)
