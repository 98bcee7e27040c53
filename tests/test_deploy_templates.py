"""The scheduler templates under deploy/: their structure, and the sbatch script's own logic.

The Kubernetes Job (work-queue pattern, pod failure policy, secrets from a Secret) and the
SLURM array script (requeue, warning signal, one job step, threads per task) are checked
field by field; each check is shown to catch the bad case. The sbatch script also runs here,
under bash, with stand-ins for srun and scontrol: it requeues exactly on the worker's requeue
status. tests/test_slurm.py runs it under a real SLURM (slow tier).
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "worker-job.yaml"
SBATCH = ROOT / "deploy" / "slurm" / "worker.sbatch"
# The worker's "requeue me" exit status, as both templates name it (docs/remote.md, "Preemption").
REQUEUE_STATUS = 75
SECRET_VARS = {
    "WORKBENCH_STORAGE",
    "PGPASSWORD",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
}


def worker_options() -> set[str]:
    """Every option name `workbench worker` accepts."""
    from studies.ablation.worker import worker

    return {opt for param in worker.params for opt in param.opts}


def manifest_problems(job: dict) -> list[str]:
    """What keeps ``job`` from being a work-queue Job of workers with the failure policy and secrets it needs."""
    problems = []
    spec = job.get("spec", {})
    if (job.get("apiVersion"), job.get("kind")) != ("batch/v1", "Job"):
        problems.append(f"not a batch/v1 Job: {job.get('apiVersion')} {job.get('kind')}")
    if not isinstance(spec.get("parallelism"), int) or spec["parallelism"] < 1:
        problems.append(f"parallelism {spec.get('parallelism')!r}: the number of workers")
    if "completions" in spec:
        problems.append("completions is set: the work-queue pattern leaves it unset")
    pod = spec.get("template", {}).get("spec", {})
    if pod.get("restartPolicy") != "Never":
        problems.append(f"restartPolicy {pod.get('restartPolicy')!r}: podFailurePolicy needs Never")
    (container,) = [c for c in pod.get("containers", []) if c.get("name") == "worker"] or [{}]
    if container.get("command") != ["workbench", "worker"]:
        problems.append(f"command {container.get('command')!r}: not `workbench worker`")
    args = container.get("args", [])
    unknown = sorted({a for a in args if a.startswith("--")} - worker_options())
    if unknown:
        problems.append(f"args the worker does not take: {unknown}")
    if any(re.search(r"://[^/@\s]*:[^/@\s]*@", str(a)) for a in args):
        problems.append("a password in the args")
    env = {e["name"]: e for e in container.get("env", [])}
    for name in sorted(SECRET_VARS):
        ref = env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")
        if not ref:
            problems.append(f"{name} is not taken from a Secret")
        elif "value" in env[name]:
            problems.append(f"{name} has a literal value")
    if "MLFLOW_TRACKING_URI" not in env:
        problems.append("no MLFLOW_TRACKING_URI: each pod would log to a store of its own")
    rules = spec.get("podFailurePolicy", {}).get("rules", [])

    def action_for(exit_code=None, condition=None) -> str | None:
        for rule in rules:  # the first matching rule decides, as the Job controller does
            codes = rule.get("onExitCodes")
            if exit_code is not None and codes and codes.get("containerName") == "worker":
                if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                    return rule["action"]
            conditions = [c.get("type") for c in rule.get("onPodConditions", [])]
            if condition is not None and condition in conditions:
                return rule["action"]
        return None

    expected = {
        "preemption (DisruptionTarget)": (action_for(condition="DisruptionTarget"), "Ignore"),
        f"the requeue status {REQUEUE_STATUS}": (action_for(exit_code=REQUEUE_STATUS), "Ignore"),
        "a usage error (exit 2)": (action_for(exit_code=2), "FailJob"),
        "a crash (exit 1), counted against backoffLimit": (action_for(exit_code=1), None),
    }
    for what, (got, want) in expected.items():
        if got != want:
            problems.append(f"podFailurePolicy on {what}: {got}, not {want}")
    return problems


def test_the_kubernetes_job_is_a_work_queue_of_workers_with_secrets_and_a_failure_policy():
    (job,) = yaml.safe_load_all(MANIFEST.read_text())
    assert manifest_problems(job) == []
    assert job["spec"]["podFailurePolicy"]["rules"][0]["action"] == "Ignore"


# fmt: skip
@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda j: j["spec"].update(completions=4), "completions is set"),
        (
            lambda j: j["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
            "restartPolicy",
        ),
        (lambda j: _container(j).update(command=["workbench", "ablate"]), "not `workbench worker`"),
        (lambda j: _container(j)["args"].append("--jobs"), "args the worker does not take"),
        (
            lambda j: _container(j)["args"].extend(["--storage", "postgresql://u:pw@db/q"]),
            "a password in the args",
        ),
        (
            lambda j: _env(j, "WORKBENCH_STORAGE").update(value="x", valueFrom={}),
            "WORKBENCH_STORAGE is not taken",
        ),
        (
            lambda j: _env(j, "MLFLOW_TRACKING_PASSWORD").pop("valueFrom"),
            "MLFLOW_TRACKING_PASSWORD is not taken",
        ),
        (lambda j: j["spec"]["podFailurePolicy"]["rules"].pop(0), "DisruptionTarget"),
        (lambda j: _rule(j, "Ignore", 1)["onExitCodes"].update(values=[143]), "requeue status"),
        (lambda j: _rule(j, "FailJob")["onExitCodes"].update(values=[1, 2]), "a crash (exit 1)"),
        (lambda j: _rule(j, "FailJob")["onExitCodes"].update(operator="NotIn"), "usage error"),
    ],
)
def test_the_manifest_check_catches_each_bad_case(edit, problem):
    (job,) = yaml.safe_load_all(MANIFEST.read_text())
    bad = copy.deepcopy(job)
    edit(bad)
    found = manifest_problems(bad)
    assert any(problem in p for p in found), found


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _env(job: dict, name: str) -> dict:
    return next(e for e in _container(job)["env"] if e["name"] == name)


def _rule(job: dict, action: str, nth: int = 0) -> dict:
    return [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == action][nth]


def sbatch_lines(text: str) -> dict[str, str]:
    """``--option`` -> value of each ``#SBATCH`` line (``""`` for a flag)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            name, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            found[name] = value
    return found


def sbatch_problems(text: str) -> list[str]:
    """What keeps an sbatch script from running requeueable, signalled array workers."""
    lines = sbatch_lines(text)
    problems = []
    if "--requeue" not in lines:
        problems.append("no --requeue: a preempted task is not requeued")
    signal = re.fullmatch(r"(B:)?(TERM|USR1)@(\d+)", lines.get("--signal", ""))
    if not signal or int(signal.group(3)) < 60:
        problems.append(
            f"--signal={lines.get('--signal')}: TERM or USR1, a minute or more before the limit"
        )
    elif signal.group(1):
        problems.append("--signal=B:...: only the batch shell would get it, not the worker")
    if not re.fullmatch(r"\d+(-\d+)?(%\d+)?", lines.get("--array", "")):
        problems.append(f"--array={lines.get('--array')}: not an array of tasks")
    if lines.get("--ntasks") != "1" or not lines.get("--cpus-per-task", "").isdigit():
        problems.append("one task per array element, with --cpus-per-task")
    if lines.get("--open-mode") != "append":
        problems.append("--open-mode is not append: a requeued task would overwrite its log")
    srun = [line for line in text.splitlines() if line.lstrip().startswith("srun ")]
    if len(srun) != 1 or '--cpus-per-task="$threads"' not in srun[0]:
        problems.append("the worker is not one srun step with --cpus-per-task")
    if '--threads "$threads"' not in text or "threads=${SLURM_CPUS_PER_TASK" not in text:
        problems.append("the worker's --threads is not the task's CPUs")
    if re.search(r"--storage\s+\S*://", text) or re.search(
        r"PASSWORD=\S", text.replace("PASSWORD=...", "")
    ):
        problems.append("a secret on a command line")
    return problems


def test_the_sbatch_script_asks_for_requeue_a_warning_signal_and_threads_per_task():
    text = SBATCH.read_text()
    assert sbatch_problems(text) == []
    lines = sbatch_lines(text)
    assert lines["--signal"] == "TERM@300" and lines["--cpus-per-task"] == "4", lines
    assert f"REQUEUE_STATUS=${{WORKBENCH_REQUEUE_STATUS:-{REQUEUE_STATUS}}}" in text


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("#SBATCH --requeue\n", "", "no --requeue"),
        ("--signal=TERM@300", "--signal=TERM@10", "--signal=TERM@10"),
        ("--signal=TERM@300", "--signal=B:USR1@300", "only the batch shell"),
        ("#SBATCH --array=0-3", "#SBATCH --array=x", "not an array"),
        ("--open-mode=append", "--open-mode=truncate", "--open-mode"),
        ('srun --ntasks=1 --cpus-per-task="$threads" ', "", "one srun step"),
        ('--threads "$threads"', "--threads 1", "--threads is not"),
        ("worker --device", "worker --storage postgresql://u:pw@db/q --device", "a secret"),
    ],
)
def test_the_sbatch_check_catches_each_bad_case(old, new, problem):
    text = SBATCH.read_text()
    assert old in text
    found = sbatch_problems(text.replace(old, new))
    assert any(problem in p for p in found), found


@pytest.fixture
def fake_slurm(tmp_path):
    """``srun`` that runs its command (dropping its own options) and ``scontrol`` that records its args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\necho "srun $*" >> "$CALLS"\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "scontrol $*" >> "$CALLS"\n')
    worker = bin_dir / "fake-worker"  # exits with the status the test asks for
    worker.write_text('#!/bin/bash\necho "worker $*" >> "$CALLS"\nexit "$FAKE_STATUS"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def run_sbatch(
    fake_slurm: Path, tmp_path: Path, status: int, **env
) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    base = {
        "PATH": f"{fake_slurm}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "CALLS": str(calls),
        "FAKE_STATUS": str(status),
        "WORKBENCH_CMD": str(fake_slurm / "fake-worker"),
        "WORKBENCH_STORAGE": "postgresql://worker@db/optuna",
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:1",
        "SLURM_JOB_ID": "41",
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_CPUS_PER_TASK": "2",
    }
    done = subprocess.run(
        ["bash", str(SBATCH)], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("status", [0, 1, REQUEUE_STATUS])
def test_the_sbatch_script_requeues_its_task_on_the_requeue_status_only(
    fake_slurm, tmp_path, status
):
    done, calls = run_sbatch(fake_slurm, tmp_path, status, WORKBENCH_DATA_PATH="/data/fm")
    assert done.returncode == status, done.stdout + done.stderr
    srun, worker, *rest = calls
    assert srun.startswith("srun --ntasks=1 --cpus-per-task=2 "), calls
    args = shlex.split(worker)[1:]
    assert args[:5] == ["worker", "--device", "cpu", "--threads", "2"], args
    assert {a for a in args if a.startswith("--")} <= worker_options(), args
    assert args[args.index("--data-path") + 1] == "/data/fm" and "--storage" not in args, args
    assert rest == (["scontrol requeue 41"] if status == REQUEUE_STATUS else []), calls


@pytest.mark.parametrize("missing", ["WORKBENCH_STORAGE", "MLFLOW_TRACKING_URI"])
def test_the_sbatch_script_stops_in_one_line_without_the_queue_or_the_server(
    fake_slurm, tmp_path, missing
):
    done, calls = run_sbatch(fake_slurm, tmp_path, 0, **{missing: ""})
    assert done.returncode == 2 and calls == [], (done.returncode, calls)
    assert done.stderr.strip().splitlines() == [
        f'worker.sbatch: {missing} is not set in the submitting environment (docs/remote.md, "SLURM")'
    ]
