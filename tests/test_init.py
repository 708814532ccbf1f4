"""`import jaxformer`: the names a user calls, each one importable, and no more (the layers
the models are built from stay in their modules)."""

import jaxformer


def test_the_public_surface_is_what_a_user_calls():
    assert sorted(jaxformer.__all__) == sorted(set(jaxformer.__all__))
    assert all(hasattr(jaxformer, name) for name in jaxformer.__all__)
    for name in ("Decoder", "DecoderConfig", "generate", "stream", "KVCache", "load_hf", "save_hf", "load_tokenizer",
                 "Engine", "perplexity"):
        assert name in jaxformer.__all__, name
    for internal in ("attention_weights", "combine_values", "Residual", "Block", "RMSNorm", "apply_rope", "LayerKV"):
        assert internal not in jaxformer.__all__, internal
    assert len(jaxformer.__all__) <= 30
