"""Parameters are arguments of the compiled programs, never constants in them.

An array a jitted function closes over is compiled into its program as a constant: a copy
of the weights inside every program that reads them (a 1B model's step then carries 2.5 GB
of literals), placed on one device whatever its sharding, and never cached. Every program a
user's path compiles (`every_program.py`) is lowered with `JAX_DUMP_IR_TO`, and each
constant in its StableHLO is weighed by its type."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import Decoder, DecoderConfig

LIMIT = 64 * 1024  # bytes: more than any index table or mask a program builds at trace time
HERE = Path(__file__).parent
# `%c = stablehlo.constant dense<...> : tensor<4x8xf32>`; a splat (one value, `dense<0.0>`)
# is broadcast by XLA, not stored, so only a constant with its values spelled out counts.
CONSTANT = re.compile(r"stablehlo\.constant dense<([^>]*)> : tensor<([^>]*)>")
BITS = {"i1": 8, "i8": 8, "ui8": 8, "bf16": 16, "f16": 16, "i16": 16, "f32": 32, "i32": 32, "ui32": 32,
        "f64": 64, "i64": 64, "ui64": 64}


def large_constants(folder: Path, limit: int = LIMIT) -> list[str]:
    """`"file: shape dtype (bytes)"` for each constant of more than `limit` bytes in the
    StableHLO modules `JAX_DUMP_IR_TO` wrote into `folder`."""
    found = []
    for path in sorted(folder.glob("*.mlir")):
        for values, tensor in CONSTANT.findall(path.read_text()):
            *dims, dtype = tensor.split("x")
            nbytes = int(np.prod([int(d) for d in dims])) * BITS[dtype] // 8
            splat = not values.startswith(("[", '"'))
            if nbytes > limit and not splat:
                found.append(f"{path.name}: {tensor} ({nbytes:,} bytes)")
    return found


def dump_programs(tmp_path: Path, args: list[str]) -> Path:
    """Runs `python *args` with every lowered program written to `tmp_path / "ir"`."""
    folder = tmp_path / "ir"
    env = {**os.environ, "JAX_DUMP_IR_TO": str(folder), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, *args], cwd=HERE.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def test_no_program_of_a_users_path_holds_a_large_constant(tmp_path):
    folder = dump_programs(tmp_path, [str(HERE / "every_program.py"), str(tmp_path / "scratch")])
    names = {p.name.split("_", 3)[-1] for p in folder.glob("*.mlir")}
    # The programs under test were all lowered (names as jit gives them: the functions' own).
    for program in ("train_step", "piece", "step", "_held_out_sums"):
        assert any(program in n for n in names), (program, sorted(names))
    assert large_constants(folder) == []


def test_the_check_finds_a_closed_over_parameter(tmp_path):
    """The same check flags a model whose jitted forward reads its parameters from the enclosing
    scope, the mistake the test above guards against (each MLP matrix, 128 x 512 floats, over the limit)."""
    folder = dump_programs(tmp_path, ["-c", "import sys; sys.path.insert(0, 'tests'); "
                                            "from test_constants import closed_over_forward; closed_over_forward()"])
    found = large_constants(folder)
    assert any("128x512xf32" in f for f in found), found


def test_large_constants_weighs_by_type_and_skips_splats(tmp_path):
    (tmp_path / "m.mlir").write_text(
        '%0 = stablehlo.constant dense<0.000000e+00> : tensor<1024x1024xf32>\n'
        '%1 = stablehlo.constant dense<"0x0000"> : tensor<256x257xbf16>\n'
        '%2 = stablehlo.constant dense<[1, 2]> : tensor<2xi32>\n')
    assert large_constants(tmp_path) == ["m.mlir: 256x257xbf16 (131,584 bytes)"]


def closed_over_forward() -> None:
    """A forward pass closing over its parameters (run in its own process by the test above)."""
    model = Decoder(DecoderConfig(vocab_size=256, n_layer=1, n_head=2, d_model=128, d_ff=512, max_seq_len=16))
    params = model.init(jax.random.key(0), *model.init_inputs())["params"]
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[0])
    forward(jnp.zeros((1, 4), jnp.int32)).block_until_ready()
