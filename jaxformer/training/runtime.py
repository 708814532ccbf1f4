"""Process-wide setup a training program does first: joining other hosts, and keeping
compiled programs on disk."""

from __future__ import annotations

import os
from pathlib import Path

import jax


def initialize_distributed() -> bool:
    """Joins the other processes of a multi-host run when the environment names some
    (docs/sharding.md, "Several hosts"); call it before anything touches a device.

    Returns:
      Whether it initialized (False on a single host).
    """
    # Slurm, Open MPI and TPU pod slices tell jax.distributed everything; elsewhere the JAX_* variables do.
    explicit = "JAX_COORDINATOR_ADDRESS" in os.environ
    if not (explicit or int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "OMPI_MCA_orte_hnp_uri" in os.environ
            or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")):
        return False
    counts = {}
    if explicit and "JAX_NUM_PROCESSES" in os.environ:
        counts = dict(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ.get("JAX_PROCESS_ID", "0")))
    jax.distributed.initialize(**counts)
    return True


def enable_compilation_cache(directory=None) -> Path:
    """Keeps compiled XLA programs on disk, so a second run skips compilation.

    Args:
      directory: where; defaults to `$JAXFORMER_CACHE_DIR`, else `~/.cache/jaxformer/xla`.

    Returns:
      The directory used.
    """
    directory = Path(directory or os.environ.get("JAXFORMER_CACHE_DIR") or Path.home() / ".cache" / "jaxformer" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache every program that took noticeable time to compile, however small its binary.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
