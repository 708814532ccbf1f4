"""Attention as hand-written Pallas kernels, one module per accelerator backend."""
