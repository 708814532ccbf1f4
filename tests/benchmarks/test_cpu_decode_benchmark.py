"""`python -m benchmarks.cpu_decode` and its GGUF files on a tiny random Llama checkpoint (no timing
asserted): the GGUF llama.cpp loads holds llama.cpp's names, layouts and hyperparameters, its RoPE
factors are Llama 3's formula, and llama.cpp's float32 logits and greedy tokens equal jaxformer's
(which only a right renaming, q/k permutation and set of factors give); llama.cpp's quantizer puts
every matrix in the asked format; the benchmark runs end to end; without the cpu-peer extra it says
what to install."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import cpu_decode, llama_1b
from jaxformer import Decoder, generate
from jaxformer.convert import config_from_hf, load_hf
from jaxformer.positions import rope_inv_freq

# Two layers of width 64 (4 query heads of 16 sharing 2 kv heads), RoPE scaled as Llama 3 does but
# over a trained context of 64: at head_dim 16 and base 10,000 the pairs' wavelengths (6.3, 20, 63,
# 199, ...) fall in all three of its regions (kept below 16, blended from 16 to 64, stretched above).
TINY = dict(llama_1b.CONFIG, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, num_hidden_layers=2, vocab_size=320, max_position_embeddings=512,
            rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64})
PROMPT = 40  # positions past the trained context's 16-wavelength region: every RoPE factor turns the scores


@pytest.fixture(scope="module")
def extra():
    """The cpu-peer extra's modules, or a skip that says how to get them."""
    reason = ("{} is missing: these tests need the cpu-peer extra, "
              "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install -e '.[cpu-peer]'")
    return (pytest.importorskip("gguf", reason=reason.format("gguf")),
            pytest.importorskip("llama_cpp", reason=reason.format("llama_cpp")))


def write_tiny(folder: str, tied: bool) -> str:
    """A bfloat16 checkpoint of `TINY` (its head tied or not), as `benchmarks.llama_1b` writes the 1B:
    matrices N(0, 0.2^2), norm weights 1 + N(0, 0.1^2) (so a wrong norm's name would show)."""
    config = dict(TINY, tie_word_embeddings=tied)
    shapes = llama_1b.tensor_shapes(config)
    rng = np.random.default_rng(0)

    def draw(name):
        dims = shapes[name]
        w = 1 + 0.1 * rng.standard_normal(dims) if len(dims) == 1 else 0.2 * rng.standard_normal(dims)
        return w.astype(ml_dtypes.bfloat16)

    os.makedirs(folder)
    weight_map = llama_1b.write_shards(folder, {name: (dims, ml_dtypes.bfloat16) for name, dims in shapes.items()},
                                      draw)
    return llama_1b.write_folder_files(folder, config, 0, weight_map, llama_1b.tokenizer())


@pytest.fixture(scope="module", params=["tied", "untied"])
def checkpoint(request, tmp_path_factory, extra):
    """`(folder, gguf_path, tied)`: a tiny checkpoint, its float32 GGUF, and whether its head is tied."""
    from benchmarks.gguf_file import write_gguf

    root, tied = tmp_path_factory.mktemp(request.param), request.param == "tied"
    folder = write_tiny(str(root / "checkpoint"), tied)
    return folder, write_gguf(folder, str(root / "model-F32.gguf")), tied


def hf_tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out |= {k: np.asarray(v, np.float32) for k, v in load_file(os.path.join(folder, name)).items()}
    return out


def test_the_gguf_holds_llama_cpps_names_layouts_and_hyperparameters(checkpoint, extra):
    gguf, _ = extra
    folder, path, tied = checkpoint
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    assert set(tensors) == {"rope_freqs.weight", "token_embd.weight", "output_norm.weight",
                            *([] if tied else ["output.weight"]),
                            *(f"blk.{i}.{name}.weight" for i in range(2) for name in layer)}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    hf = hf_tensors(folder)
    # GGUF lists a tensor's dims fastest first: numpy's reversed (a Linear's [out, in] is {in, out}).
    q = tensors["blk.1.attn_q.weight"]
    assert list(q.shape) == [64, 64] and list(tensors["blk.1.attn_k.weight"].shape) == [64, 32]
    assert list(tensors["token_embd.weight"].shape) == [64, 320] and list(tensors["blk.0.ffn_down.weight"].shape) == [
        128, 64]
    for hf_name, name in (("model.embed_tokens.weight", "token_embd"), ("model.layers.1.self_attn.v_proj.weight",
                          "blk.1.attn_v"), ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down"),
                          ("model.layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm"),
                          ("model.norm.weight", "output_norm"), *([] if tied else [("lm_head.weight", "output")])):
        np.testing.assert_array_equal(tensors[name + ".weight"].data, hf[hf_name])
    # q's and k's rows, per head: Hugging Face's halves (i, i + 8) become adjacent rows (2i, 2i + 1).
    for part, heads in (("q", 4), ("k", 2)):
        w = hf[f"model.layers.1.self_attn.{part}_proj.weight"].reshape(heads, 2, 8, 64)  # [head, half, i, in]
        adjacent = w.transpose(0, 2, 1, 3).reshape(heads * 16, 64)  # [head, i, half, in]
        np.testing.assert_array_equal(tensors[f"blk.1.attn_{part}.weight"].data, adjacent)
    fields = {key: reader.fields[key].contents() for key in reader.fields if not key.startswith("GGUF.")}
    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == 0
    assert {key: fields["llama." + key] for key in (
        "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
        "vocab_size", "rope.freq_base")} == {
        "context_length": 512, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
        "attention.value_length": 16, "rope.dimension_count": 16, "vocab_size": 320, "rope.freq_base": 10000.0}
    assert fields["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "llama" and len(tokens) == len(types) == 320
    assert len(set(tokens)) == 320 and len(fields["tokenizer.ggml.scores"]) == 320
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[258] == "<0xFF>"
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert set(types[3:259]) == {gguf.TokenType.BYTE} and set(types[259:]) == {gguf.TokenType.NORMAL}
    assert (fields["tokenizer.ggml.unknown_token_id"], fields["tokenizer.ggml.bos_token_id"],
            fields["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)


@pytest.mark.parametrize("shape", ["tiny", "1b", "8b"])
def test_the_rope_factors_are_llama3s_formula(shape, extra):
    from benchmarks.gguf_file import llama3_rope_factors

    hf = {"tiny": TINY, "1b": llama_1b.CONFIG, "8b": llama_1b.CONFIG_8B}[shape]
    config, scaling = config_from_hf(hf), hf["rope_scaling"]
    factors = llama3_rope_factors(config)
    theta, head_dim = hf["rope_theta"], hf["head_dim"]
    assert factors.shape == (head_dim // 2,) and factors.dtype == np.float32
    # llama.cpp turns pair i at theta^(-2i/d) / factors[i]: Hugging Face's llama3 frequencies, as
    # jaxformer computes them in float32 (the ratio agrees to float32's rounding of those steps).
    unscaled = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(unscaled / factors, rope_inv_freq(head_dim, theta, config.rope_scaling), rtol=1e-6)
    # The three regions, by wavelength against the trained context C: kept below C / high, stretched
    # `factor` times above C / low, strictly between the two in between.
    wavelength, context = 2 * np.pi / unscaled, scaling["original_max_position_embeddings"]
    short, long = wavelength < context / scaling["high_freq_factor"], wavelength > context / scaling["low_freq_factor"]
    assert short.any() and long.any() and (~short & ~long).any()
    assert np.all(factors[short] == 1) and np.all(factors[long] == np.float32(scaling["factor"]))
    assert np.all((factors[~short & ~long] > 1) & (factors[~short & ~long] < scaling["factor"]))


def test_llama_cpps_float32_logits_and_greedy_tokens_equal_jaxformers(checkpoint, extra):
    _, llama_cpp = extra
    folder, path, _ = checkpoint
    ids = cpu_decode.prompt_ids(1, PROMPT, 320)  # [1, PROMPT]
    llm = llama_cpp.Llama(model_path=path, n_threads=2, n_ctx=64, n_batch=PROMPT, logits_all=True, verbose=False,
                          type_k=0, type_v=0)  # (GGML_TYPE_F32: keys and values cached in float32, as jaxformer's)
    llm.eval(ids[0].tolist())
    theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(PROMPT, 320)).copy()
    config, params = load_hf(folder, max_seq_len=64)
    ours = np.asarray(Decoder(config).apply({"params": params}, jnp.asarray(ids))[0][0])  # [PROMPT, vocab]
    # The two sum in different orders (llama.cpp in SIMD partial sums): a float32 sum of K terms may
    # round by up to K * 2^-24 of their magnitudes; K = 128, the widest sum here (the FFN's), at the
    # logits' scale. (They differ by about a tenth of it.)
    tolerance = 128 * 2.0 ** -24 * np.abs(ours).max()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=tolerance)
    # At these positions the Llama 3 factors count far beyond the tolerance: the rope_freqs tensor is read.
    unscaled = Decoder(config.replace(rope_scaling=None)).apply({"params": params}, jnp.asarray(ids))[0][0]
    assert np.abs(np.asarray(unscaled) - ours).max() > 100 * tolerance
    new = 8
    row = cpu_decode.llama_cpp_worker(path, "F32", cpu_decode.DECODE_PROMPT, new, threads=2)
    short = jnp.asarray(ids[:, :cpu_decode.DECODE_PROMPT])
    greedy = generate(Decoder(config), params, short, max_new_tokens=new + 1)[0, cpu_decode.DECODE_PROMPT:]
    assert row["tokens"] == np.asarray(greedy).tolist()
    assert len(set(row["tokens"])) > 1  # (not one token repeated: the steps' positions count)


def test_llama_cpps_quantizer_puts_every_matrix_in_the_asked_format(checkpoint, extra, tmp_path, capsys):
    from benchmarks.gguf_file import quantize_gguf, tensor_bytes

    _, path, _ = checkpoint
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_gguf(path, str(tmp_path / "x.gguf"), "Q5_K")
    sizes = {"F32": tensor_bytes(path)}
    for fmt in ("BF16", "Q8_0", "Q4_0"):
        dst = str(tmp_path / f"{fmt}.gguf")
        types = quantize_gguf(path, dst, fmt)
        vectors = {"rope_freqs.weight", "output_norm.weight"} | {f"blk.{i}.{n}_norm.weight" for i in range(2)
                                                                for n in ("attn", "ffn")}
        assert {name: t for name, t in types.items() if name not in vectors} == {
            name: fmt for name in types if name not in vectors}  # the embedding (and untied head) too
        assert {types[name] for name in vectors} == {"F32"}
        sizes[fmt] = tensor_bytes(dst)
        assert f"{fmt}.gguf: " in capsys.readouterr().out
    # Per 32 values: float32 128 bytes, bfloat16 64, Q8_0 32 + a 2-byte scale, Q4_0 16 + 2 (the vectors aside).
    assert sizes["F32"] > sizes["BF16"] > sizes["Q8_0"] > sizes["Q4_0"]


def test_the_benchmark_runs_end_to_end_and_writes_every_field(extra, tmp_path, capsys):
    folder = write_tiny(str(tmp_path / "checkpoint"), tied=True)
    out = tmp_path / "cpu.json"
    cpu_decode.main([folder, "--passes", "1", "--new", "4", "--prompt", "8", "--batch", "1", "2", "--out", str(out),
                     "--work", str(tmp_path / "work")])
    result = json.loads(out.read_text())
    assert sorted(os.listdir(tmp_path / "work")) == [f"model-{fmt}.gguf" for fmt in ("BF16", "F32", "Q4_0", "Q8_0")]
    assert result["floor"]["bytes_per_s"] > 0 and result["floor"]["threads"] == 2
    assert result["floor"]["bytes"] == result["rows"]["F32"]["llama.cpp"]["weight_bytes"]  # the largest weights
    assert list(result["rows"]) == list(cpu_decode.FORMATS)
    for fmt, sides in result["rows"].items():
        for impl, batches in (("llama.cpp", ["1"]), ("jaxformer", ["1", "2"])):
            row = sides[impl]
            assert row["format"] == fmt and row["passes"] == 1 and row["failed_passes"] == 0
            assert row["weights"] == (fmt if impl == "llama.cpp" else cpu_decode.JAXFORMER_NAMES[fmt])
            assert row["prompt_tokens_per_s"] > 0 and row["peak_rss"] > 0 and len(row["tokens"]) == 5
            assert list(row["decode"]) == batches
            for batch, d in row["decode"].items():
                assert d["bytes_per_s"] == pytest.approx(row["weight_bytes"] * d["tokens_per_s"] / int(batch))
                assert d["floor_share"] == pytest.approx(d["bytes_per_s"] / result["floor"]["bytes_per_s"])
        assert sides["ratio"]["decode"] == pytest.approx(
            sides["jaxformer"]["decode"]["1"]["tokens_per_s"] / sides["llama.cpp"]["decode"]["1"]["tokens_per_s"])
        assert sides["ratio"]["prompt"] == pytest.approx(
            sides["jaxformer"]["prompt_tokens_per_s"] / sides["llama.cpp"]["prompt_tokens_per_s"])
    assert result["rows"]["F32"]["same_tokens"] is True
    size = {fmt: sides["jaxformer"]["weight_bytes"] for fmt, sides in result["rows"].items()}
    assert size["F32"] == 2 * size["BF16"] and size["F32"] > size["Q8_0"] > size["Q4_0"]
    printed = capsys.readouterr().out
    for said in ("read floor:", "llama.cpp Q4_0 decode batch 1:", "jaxformer int4 decode batch 1:",
                 "jaxformer int4 decode batch 2:", "llama.cpp F32 prompt 8:", "jaxformer / llama.cpp Q8_0: decode",
                 "F32 greedy tokens agree: True"):
        assert said in printed


def test_without_the_extra_it_says_what_to_install():
    hide = ("import sys; sys.modules['llama_cpp'] = None; from benchmarks import cpu_decode; "
            "cpu_decode.main(['checkpoint'])")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [cpu_decode.INSTALL]
    assert "cpu-peer" in cpu_decode.INSTALL and 'CMAKE_ARGS="-DGGML_NATIVE=ON"' in cpu_decode.INSTALL
