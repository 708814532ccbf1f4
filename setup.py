"""Builds jaxformer's CPU products (jaxformer/kernels/cpu_products.cc, custom calls XLA runs while
decoding) where a C++ compiler is present, for this machine's instructions. Where there is none, or
the build fails, the install goes on without them and every product runs on XLA
(jaxformer/kernels/cpu.py says so once). Everything else about the package is in pyproject.toml."""

import os

import jaxlib
from setuptools import Extension, setup

products = Extension(
    "jaxformer.kernels._cpu_products",
    sources=["jaxformer/kernels/cpu_products.cc"],
    include_dirs=[os.path.join(os.path.dirname(jaxlib.__file__), "include")],  # XLA's FFI headers
    extra_compile_args=["-O3", "-march=native", "-std=c++20", "-fvisibility=hidden"],
    language="c++",
    optional=True,  # a failed build is a warning, not a failed install
)

setup(ext_modules=[products])
