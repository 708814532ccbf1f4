"""The weight products of decoding on an x86 CPU, as JAX functions: XLA custom calls to
`cpu_products.cc`, built by `pip install` where a C++ compiler is present.

Decoding multiplies a few rows of activations by every matrix once a token, so its speed is the
speed at which the matrices are read. XLA:CPU reads them slower than the machine can (float32 on
one core, bfloat16 through a float32 copy, int8 and int4 well below; docs/performance.md); these
read each in its stored layout, on both of XLA's threads, converting in registers:

- `kn_product(x, w)`: `x [R, K] . w [K, N]`, float32 or bfloat16 (a float matrix as the model holds it).
- `nk_product(x, w)`: `x [R, K] . w[N, K]^T`, the same (a tied embedding as the output head).
- `int8_product(x, w)`: int8 `x [R, K]` by int8 `w [N, K]`, summed exactly in int32.
- `int4_product(x, q, s)`: int8 `x [R, K]` by int4 `q [N, K]` in groups with float scales `s [N, groups]`:
  `sum_g s[n, g] sum_{k in g} x[r, k] q[n, k]`, each group's sum exact.

`jaxformer.products.product` calls them inside its programs where `enabled()`, and XLA's own
products everywhere else: those stay the reference these are tested against (tests/kernels/test_cpu.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp

try:
    from jaxformer.kernels import _cpu_products
except ImportError:  # not built: no compiler at install, or another platform
    _cpu_products = None

__all__ = ["disabled", "enabled", "fits", "int4_product", "int8_product", "kn_product", "nk_product"]

_PREFIX = "jaxformer_"  # the targets' names in XLA's registry


@functools.cache
def _registered() -> bool:
    """Registers the products with XLA once; whether this machine runs them (said once if not)."""
    targets = {} if _cpu_products is None else _cpu_products.targets()
    for name, handler in targets.items():
        jax.ffi.register_ffi_target(_PREFIX + name, handler, platform="cpu")
    if not targets:
        why = ("were not built (no C++ compiler at install)" if _cpu_products is None
               else "need AVX-512 and VNNI, which this processor lacks")
        logging.getLogger(__name__).warning("jaxformer: the CPU products %s; XLA's run instead", why)
    return bool(targets)


_off = 0  # how many `disabled()` blocks are open


def enabled() -> bool:
    """Whether the products run here: built, on a processor that runs them, one CPU device in one
    process (XLA cannot split a custom call across devices: a sharded program keeps XLA's), and not
    inside `disabled()`."""
    return (not _off and jax.default_backend() == "cpu" and jax.process_count() == 1
            and jax.local_device_count() == 1 and _registered())


@contextlib.contextmanager
def disabled():
    """Programs traced inside use XLA's products alone: for XLA's own view of a program (its cost
    analysis counts no custom call's arithmetic) or a program exported for the CPU (`jax.export`
    does not serialize these custom calls). A function jitted before keeps what it traced."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def fits(name: str, k: int, n: int, groups: int = 0) -> bool:
    """Whether the product `name` takes a matrix of K inputs and N outputs (int4: in `groups` groups)."""
    return {"kn_product": n % 16 == 0, "nk_product": k % 16 == 0 and n % 4 == 0,
            "int8_product": n % 4 == 0 and k < 66_000,
            "int4_product": k % 64 == 0 and groups > 0 and k % groups == 0 and k // groups in (32, 64, 128)}[name]


def _call(name: str, out: jax.ShapeDtypeStruct, *args, **attrs) -> jax.Array:
    _registered()
    return jax.ffi.ffi_call(_PREFIX + name, out, vmap_method="sequential")(*args, **attrs)


def kn_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [R, K] . w [K, N]` in float32 (x and w float32 or bfloat16; N a multiple of 16)."""
    return _call("kn_product", jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32), x, w)


def nk_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [R, K] . w [N, K]^T` in float32 (x and w float32 or bfloat16; K a multiple of 16, N of 4)."""
    return _call("nk_product", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32), x, w)


def int8_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [R, K] . w [N, K]^T` for int8 `x` and `w`, exact in int32 (N a multiple of 4, K below 66,000)."""
    return _call("int8_product", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32), x, w)


def int4_product(x: jax.Array, q: jax.Array, s: jax.Array) -> jax.Array:
    """`sum_g s[n, g] sum_{k in g} x[r, k] q[n, k]` in float32 for int8 `x [R, K]`, int4 `q [N, K]` and
    float32 or bfloat16 scales `s [N, K / G]`, G = 32, 64 or 128 (K a multiple of 64)."""
    return _call("int4_product", jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32), x, q, s)
