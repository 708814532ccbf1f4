"""`jaxformer.runtime`: joining other processes only when the environment names
them, the variables checked first, and what one process does for a run of several.
(Real processes on loopback: tests/training/test_processes.py.)"""

import socket

import jax
import pytest

from jaxformer.runtime import (
    HEARTBEAT_SECONDS,
    JOIN_SECONDS,
    LINGER_SECONDS,
    agree,
    distributed_settings,
    initialize_distributed,
    is_primary,
    join_timeout,
    local_environments,
    on_primary,
)

VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
             "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES", "JAXFORMER_JOIN_TIMEOUT")


@pytest.mark.parametrize("env, settings", [
    ({}, None),  # one host: nothing to join
    ({"SLURM_NTASKS": "1"}, None),
    ({"SLURM_NTASKS": "4"}, {}),  # jax reads Slurm's variables itself
    ({"TPU_WORKER_HOSTNAMES": "host0,host1"}, {}),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SLURM_NTASKS": "4"}, {"coordinator_address": "10.0.0.1:1234"}),
])
def test_the_environment_names_the_other_processes_or_none(env, settings):
    assert distributed_settings(env) == settings


@pytest.mark.parametrize("env, message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"},
     "JAX_NUM_PROCESSES=2 but JAX_PROCESS_ID is not set: give each process its own id, 0 to 1"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES=2 but JAX_COORDINATOR_ADDRESS is not set"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID set but JAX_NUM_PROCESSES is not"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES is not"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"},
     "JAX_PROCESS_ID must be an int >= 0 (got '-1')"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES must be an int >= 1 (got '0')"),
    ({"JAX_COORDINATOR_ADDRESS": "host0", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS must be host:port"),
])
def test_a_wrong_environment_is_refused_in_one_line_naming_the_variable(env, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as caught:
        distributed_settings(env)
    assert "\n" not in str(caught.value)


def test_the_join_timeout_is_read_from_the_environment():
    assert join_timeout({}) == JOIN_SECONDS
    assert join_timeout({"JAXFORMER_JOIN_TIMEOUT": "7"}) == 7
    with pytest.raises(ValueError, match="JAXFORMER_JOIN_TIMEOUT must be an int >= 1"):
        join_timeout({"JAXFORMER_JOIN_TIMEOUT": "soon"})


@pytest.fixture
def clean_environment(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_initialize_joins_with_bounded_timeouts_and_only_when_named(clean_environment):
    monkeypatch = clean_environment
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr("jaxformer.runtime.leave_at_once_on_failure",
                        lambda linger: calls.append(("leave", linger)))
    assert initialize_distributed() is False and calls == []
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("JAXFORMER_JOIN_TIMEOUT", "9")
    assert initialize_distributed() is True
    assert calls == [{"initialization_timeout": 9 + 30, "heartbeat_timeout_seconds": HEARTBEAT_SECONDS,
                      "shutdown_timeout_seconds": 60}, ("leave", LINGER_SECONDS)]


def test_process_0_is_refused_a_coordinator_port_already_in_use(clean_environment):
    monkeypatch = clean_environment
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: pytest.fail("must not join"))
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in (("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}"), ("JAX_NUM_PROCESSES", "2"),
                            ("JAX_PROCESS_ID", "0")):
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"process 0 serves the coordinator on port {port}, which is in use"):
            initialize_distributed()


def test_another_process_is_refused_an_unreachable_coordinator_within_the_timeout(clean_environment):
    monkeypatch = clean_environment
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: pytest.fail("must not join"))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        for name, value in (("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}"), ("JAX_NUM_PROCESSES", "2"),
                            ("JAX_PROCESS_ID", "1"), ("JAXFORMER_JOIN_TIMEOUT", "1")):
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"cannot reach the coordinator at JAX_COORDINATOR_ADDRESS "
                                             f"127.0.0.1:{port} within 1 s"):
            initialize_distributed()


def test_on_one_process_it_is_the_primary_and_checks_are_its_own():
    assert is_primary()
    assert on_primary(lambda: 7) == 7
    with pytest.raises(ValueError, match="^refused$"):
        on_primary(lambda: (_ for _ in ()).throw(ValueError("refused")))
    agree(True, "unused")
    with pytest.raises(ValueError, match="^not shared$"):
        agree(False, "not shared")


def test_local_environments_name_a_run_of_processes_on_loopback():
    one, = local_environments(1, 8, {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false", "JAX_PROCESS_ID": "5"})
    assert "JAX_PROCESS_ID" not in one and "JAX_COORDINATOR_ADDRESS" not in one
    assert one["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=8"
    two = local_environments(2, 4, {})
    assert [distributed_settings(env)["process_id"] for env in two] == [0, 1]
    assert {env["JAX_COORDINATOR_ADDRESS"] for env in two} == {two[0]["JAX_COORDINATOR_ADDRESS"]}
    assert two[0]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:") and two[0]["JAX_PLATFORMS"] == "cpu"
    with pytest.raises(ValueError, match="count must be"):
        local_environments(0, 4)
