"""`jaxformer.training.runtime`: multi-host start only when the environment names other hosts."""

import jax
import pytest

from jaxformer.training import initialize_distributed


@pytest.mark.parametrize("env, called_with", [
    ({}, None),  # one host: nothing to join
    ({"SLURM_NTASKS": "1"}, None),
    ({"SLURM_NTASKS": "4"}, {}),  # jax reads Slurm's variables itself
    ({"TPU_WORKER_HOSTNAMES": "host0,host1"}, {}),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     {"num_processes": 2, "process_id": 1}),
])
def test_initialize_distributed_only_when_the_environment_names_other_hosts(monkeypatch, env, called_with):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                 "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    assert initialize_distributed() == (called_with is not None)
    assert calls == ([] if called_with is None else [called_with])
