"""Runs of several processes, started for real: 2 processes on loopback with 4 CPU devices
each (JAX's multi-controller runtime, gloo collectives), against 1 process with 8.

Each process is bounded in time and killed by its test if it outlives it."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import import_peer

sys.path.insert(0, str(Path(__file__).parent.parent / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer.runtime import HEARTBEAT_SECONDS, local_environments  # noqa: E402
from jaxformer.training import lock_run_dir  # noqa: E402

ROOT = Path(__file__).parent.parent.parent
LM = ["-m", "train.lm", "--steps", "6", "--warmup", "2", "--batch-size", "16", "--n-layer", "2", "--d-model", "64",
      "--checkpoint-every", "3", "--log-every", "1", "--eval-size", "16"]
DP, FSDP_TP = ["--mesh", "data=8"], ["--mesh", "data=4,model=2", "--fsdp"]
TOLERANCE = 1e-5  # the same program split otherwise: the sums' order may differ


@dataclasses.dataclass
class Ended:
    status: int
    stdout: str
    stderr: str

    @property
    def errors(self) -> list[str]:
        """stderr's lines, less gloo's notes of the connections it made."""
        return [line for line in self.stderr.splitlines() if line.strip() and not line.startswith("[Gloo]")]


def start(args, folder: Path, count: int = 2, devices: int = 4, ids=None, env=None, delays=(),
          cwds=None) -> list[subprocess.Popen]:
    """`count` processes of one run on loopback (`local_environments`), or with `ids` as
    their JAX_PROCESS_IDs; `env` added to each, each started `delays[i]` seconds after the
    one before, in `cwds[i]` (default: the repository). Their output goes to files in
    `folder` (a pipe left unread would stop them)."""
    environments = local_environments(count, devices)
    if ids is not None:
        environments = [{**environments[0], "JAX_PROCESS_ID": str(i)} for i in ids]
    processes = []
    for i, environment in enumerate(environments):
        time.sleep(delays[i] if i < len(delays) else 0)
        out, err = (open(folder / f"{name}-{i}-{time.monotonic_ns()}.txt", "w+") for name in ("out", "err"))
        processes.append(subprocess.Popen([sys.executable, *args], cwd=cwds[i] if cwds else ROOT,
                                          env={**environment, "PYTHONPATH": str(ROOT), **(env or {})},
                                          stdout=out, stderr=err, start_new_session=True))
        processes[-1].files = (out, err)
    return processes


def finish(processes: list[subprocess.Popen], timeout: float = 300) -> list[Ended]:
    """Waits for every process, each within `timeout` seconds in all; kills what is left."""
    deadline = time.monotonic() + timeout
    try:
        for p in processes:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    ended = []
    for p in processes:
        for f in p.files:
            f.seek(0)
        ended.append(Ended(p.returncode, *(f.read() for f in p.files)))
        for f in p.files:
            f.close()
    return ended


def run(args, folder: Path, count: int = 2, devices: int = 4) -> list[Ended]:
    """`start` then `finish`; every process must end with status 0."""
    ended = finish(start(args, folder, count, devices))
    for i, e in enumerate(ended):
        assert e.status == 0, f"process {i}: {e.status}\n{e.stdout[-2000:]}\n{e.stderr[-4000:]}"
    return ended


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps))  # each logged step once: process 0 alone writes
    return [line["loss"] for line in lines]


def one_process(args, folder: Path) -> list[Ended]:
    return run(args, folder, count=1, devices=8)


def test_train_lm_on_two_processes_has_the_losses_of_one_and_resumes_across_layouts(tmp_path):
    for mesh in (DP, FSDP_TP):
        name = "fsdp" if "--fsdp" in mesh else "dp"
        one_process([*LM, *mesh, "--run-dir", str(tmp_path / f"one-{name}")], tmp_path)
        two = run([*LM, *mesh, "--run-dir", str(tmp_path / f"two-{name}")], tmp_path)
        expected = losses(tmp_path / f"one-{name}")
        assert len(expected) == 6
        np.testing.assert_allclose(losses(tmp_path / f"two-{name}"), expected, rtol=0, atol=TOLERANCE)
        assert sorted(p.name for p in (tmp_path / f"two-{name}" / "checkpoints").iterdir()) == ["3", "6"]
        assert all("exact match" in e.stdout for e in two)  # each process evaluated, process 0 wrote
        assert json.loads((tmp_path / f"two-{name}" / "eval.json").read_text())["steps"] == 6
    # Interrupted after the checkpoint of step 3 (its later one gone): resumed by 2 processes, and by 1.
    for where, resume in (("resumed-two", run), ("resumed-one", lambda args, folder: one_process(args, folder))):
        shutil.copytree(tmp_path / "two-fsdp", tmp_path / where)
        shutil.rmtree(tmp_path / where / "checkpoints" / "6")
        ended = resume([*LM, *FSDP_TP, "--resume", "--run-dir", str(tmp_path / where)], tmp_path)
        assert "resuming at step 3 of 6" in ended[0].stdout
        np.testing.assert_allclose(losses(tmp_path / where), losses(tmp_path / "one-fsdp"), rtol=0, atol=TOLERANCE)


def test_train_reverse_on_two_processes_has_the_losses_of_one(tmp_path):
    reverse = ["-m", "train.reverse", "--steps", "4", "--warmup", "2", "--batch-size", "16", "--log-every", "1",
               "--checkpoint-every", "2", "--mesh", "data=8"]
    one_process([*reverse, "--run-dir", str(tmp_path / "one")], tmp_path)
    run([*reverse, "--run-dir", str(tmp_path / "two")], tmp_path)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Llama-shaped checkpoint folder with a byte-level BPE tokenizer, and text to learn."""
    path = tmp_path_factory.mktemp("processes") / "checkpoint"
    save_random_checkpoint(path)
    (path.parent / "new.txt").write_text("Keys and values are cached, so each new token costs one step. " * 30)
    return path


def test_lora_fine_tuning_over_two_processes_writes_one_adapter_and_one_merged_folder(checkpoint, tmp_path):
    torch, transformers = import_peer("torch"), import_peer("transformers")
    finetune = ["-m", "jaxformer.commands.finetune", "--checkpoint", str(checkpoint), "--data",
                str(checkpoint.parent / "new.txt"), "--steps", "8", "--lr", "1e-2", "--log-every", "4",
                "--checkpoint-every", "4", "--warmup", "2", "--batch-size", "4", "--seq-len", "32", "--lora-rank", "4",
                *FSDP_TP]
    one_process([*finetune, "--run-dir", str(tmp_path / "one"), "--merge", str(tmp_path / "merged-one")], tmp_path)
    two = run([*finetune, "--run-dir", str(tmp_path / "two"), "--merge", str(tmp_path / "merged-two")], tmp_path)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=TOLERANCE)
    assert all("fine-tuned checkpoint" in e.stdout for e in two)
    assert sorted(p.name for p in (tmp_path / "two" / "adapter").iterdir()) == ["adapter_config.json",
                                                                                "adapter_model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged-two")]  # no second, cut-short write
    merged = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("merged-one",
                                                                                             "merged-two")]
    with torch.no_grad():
        for a, b in zip(*(m.state_dict().values() for m in merged)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOLERANCE)


def test_full_fine_tuning_over_two_processes_has_the_losses_of_one(checkpoint, tmp_path):
    finetune = ["-m", "jaxformer.commands.finetune", "--checkpoint", str(checkpoint), "--data",
                str(checkpoint.parent / "new.txt"), "--full", "--steps", "4", "--lr", "1e-3", "--log-every", "1",
                "--checkpoint-every", "2", "--warmup", "2", "--batch-size", "4", "--seq-len", "32",
                "--mesh", "data=2,model=4", "--fsdp"]
    one_process([*finetune, "--run-dir", str(tmp_path / "one")], tmp_path)
    run([*finetune, "--run-dir", str(tmp_path / "two")], tmp_path)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=TOLERANCE)
    assert len(losses(tmp_path / "two")) == 4


EXPERT_MESHES = ["data=2,expert=4", "fsdp:expert=4,model=2"]  # experts within each process; across the two


def test_expert_parallelism_over_two_processes_has_one_devices_logits_and_train_step(tmp_path):
    """A decoder of mixtures of experts on 2 processes x 4 devices, its experts split over the
    mesh's `expert` axis and the tokens sent to them (`experts_on_processes.py`): its logits and
    one train step are those of one device (each process's first, alone)."""
    run([str(Path(__file__).parent / "experts_on_processes.py"), str(tmp_path / "results.npz"), *EXPERT_MESHES],
        tmp_path)
    results = np.load(tmp_path / "results.npz")
    for mesh in EXPERT_MESHES:
        np.testing.assert_allclose(results[f"{mesh}/logits"], results["one/logits"], atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(results[f"{mesh}/loss"], results["one/loss"], rtol=1e-6)
        params = [name for name in results if name.startswith("one/params")]
        assert len(params) > 10
        for name in params:
            np.testing.assert_allclose(results[name.replace("one/", f"{mesh}/")], results[name], atol=1e-6,
                                       rtol=1e-5, err_msg=f"{mesh}: {name}")


def test_a_missing_process_id_is_refused_in_one_line(tmp_path):
    [ended] = finish(start([*LM, *DP, "--run-dir", str(tmp_path / "run")], tmp_path, count=1,
                           env={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2"}), timeout=60)
    assert ended.status == 2
    assert ended.errors == ["python -m train.lm: error: JAX_NUM_PROCESSES=2 but JAX_PROCESS_ID is not set: give each "
                            "process its own id, 0 to 1"]
    assert not (tmp_path / "run").exists()


def test_two_processes_with_one_id_end_in_one_line_each_within_the_join_timeout(tmp_path):
    began = time.monotonic()
    first, second = finish(start([*LM, *DP, "--run-dir", str(tmp_path / "run")], tmp_path, ids=(0, 0),
                                 env={"JAXFORMER_JOIN_TIMEOUT": "10"}, delays=(0, 3)), timeout=120)
    assert time.monotonic() - began < 60
    assert second.status == 2 and len(second.errors) == 1
    assert "process 0 serves the coordinator on port" in second.errors[0] and "which is in use" in second.errors[0]
    assert first.status == 1 and first.errors == [
        "python -m train.lm: error: the run's 2 processes did not all join within 10 s (JAXFORMER_JOIN_TIMEOUT): one "
        "is missing, or two have the same JAX_PROCESS_ID"]
    assert not (tmp_path / "run").exists()


def test_a_mesh_that_does_not_fit_every_processs_devices_is_refused_by_each_in_one_line(tmp_path):
    ended = finish(start([*LM, "--mesh", "data=4", "--run-dir", str(tmp_path / "run")], tmp_path), timeout=120)
    for e in ended:
        assert e.status == 2
        assert e.errors == ["python -m train.lm: error: make_mesh: data * model must equal the device count 8 "
                            "(2 processes), got data=4 x model=1"]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_in_use_refuses_every_process_of_a_second_run(tmp_path):
    (tmp_path / "run").mkdir()
    with lock_run_dir(tmp_path / "run"):  # held by this process, as by another run
        ended = finish(start([*LM, *DP, "--run-dir", str(tmp_path / "run")], tmp_path), timeout=120)
    for e in ended:
        assert e.status == 2
        assert e.errors == [f"python -m train.lm: error: run directory {tmp_path / 'run'} is in use by another "
                            "process (a run, a resume or a report rebuild of it): wait for it to end, or stop it"]
    assert list((tmp_path / "run").iterdir()) == []


def test_run_directories_that_are_not_one_shared_directory_are_refused_by_every_process(tmp_path):
    hosts = [tmp_path / "host0", tmp_path / "host1"]  # "run" on each: two directories of one name
    for host in hosts:
        host.mkdir()
    ended = finish(start([*LM, *DP, "--run-dir", "run"], tmp_path, cwds=hosts), timeout=120)
    for e in ended:
        assert e.status == 2
        assert e.errors == ["python -m train.lm: error: run does not hold the config.json process 0 wrote: the "
                            "processes of a run need one run directory, on a file system they all see (on process 1)"]
    assert [list(host.iterdir()) for host in hosts] == [[], []]  # the new run undone


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])  # SIGTERM: JAX's runtime would catch it
def test_a_process_that_dies_mid_run_ends_the_other_within_the_heartbeat_timeout(tmp_path, how):
    processes = start([*LM[:2], "--steps", "5000", "--warmup", "2", "--batch-size", "16", "--n-layer", "1",
                       "--d-model", "32", "--log-every", "10", "--checkpoint-every", "1000", *DP, "--run-dir",
                       str(tmp_path / "run")], tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metrics.exists(), "training never started"
    os.killpg(processes[1].pid, how)
    killed = time.monotonic()
    survivor, dead = finish(processes, timeout=HEARTBEAT_SECONDS + 60)
    assert dead.status == -how
    assert time.monotonic() - killed < HEARTBEAT_SECONDS + 30
    assert survivor.status != 0
    # The first layer to notice says so: JAX's heartbeat ("another task died"), or gloo, in
    # a collective whose peer's socket closed mid-message.
    assert "another task died" in survivor.stderr or "gloo" in survivor.stderr, survivor.stderr[-2000:]


@pytest.mark.parametrize("method", ["dpo", "grpo"])
def test_dpo_and_grpo_over_two_processes_have_the_steps_of_one(checkpoint, tmp_path, method):
    """LoRA DPO and GRPO on 2 processes x 4 devices (FSDP and model parallelism over both): the
    losses of 1 process of 8 devices, and GRPO's completions the same (their rewards and lengths:
    each process's engine samples with the weights split over both, every process the same)."""
    data = tmp_path / "data.jsonl"
    words = ("cat", "dog", "sun", "sky", "log") * 4
    if method == "dpo":
        records = [{"prompt": f"The {w} sat on the", "chosen": " mat.", "rejected": f" {w}."} for w in words]
        extra = []
    else:
        records = [{"prompt": f"The {w} sat on the"} for w in words]
        extra = ["--num-generations", "4", "--max-completion-length", "6", "--reward", "regex", "--reward-pattern",
                 ".*a.*", "--beta", "0.04"]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    command = ["-m", "jaxformer.commands.finetune", "--checkpoint", str(checkpoint), "--data", str(data), "--method",
               method, "--steps", "4", "--lr", "3e-3", "--log-every", "1", "--checkpoint-every", "2", "--warmup", "2",
               "--batch-size", "4", "--seq-len", "24", "--lora-rank", "4", *FSDP_TP, *extra]
    one_process([*command, "--run-dir", str(tmp_path / "one")], tmp_path)
    run([*command, "--run-dir", str(tmp_path / "two")], tmp_path)
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=0, atol=TOLERANCE)
    if method == "grpo":
        one, two = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                    for name in ("one", "two"))
        assert [(m["reward"], m["completion_length"]) for m in two] == \
               [(m["reward"], m["completion_length"]) for m in one]
    assert (tmp_path / "two" / "adapter" / "adapter_config.json").exists()
