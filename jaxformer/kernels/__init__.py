"""Hand-written Pallas kernels for GPUs (Triton) and TPUs (Mosaic): attention in blocks and
while decoding, and the grouped product of a mixture of experts."""

# The custom-call targets the kernels lower to for CUDA (Pallas' Triton call: the training kernels,
# the decoding kernel and the grouped matmuls alike). `jax.export` refuses a custom call whose
# target jax does not promise to keep readable across jaxlib versions, and Triton's is one: its
# payload is the kernel's Triton IR, read by the jaxlib that runs the program. A program that
# runs the kernels exports for "cuda" with that check disabled for each of these targets
# (docs/long_context.md, "Exporting a program"); Mosaic's "tpu_custom_call" is one jax keeps, so
# a TPU export needs nothing.
CUDA_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton",)
