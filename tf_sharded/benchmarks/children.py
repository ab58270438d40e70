"""Child processes of the benchmarks: the environment they get, worker processes of one collective cluster,
running several at once, and the training application run as a user runs it."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

from tf_sharded.app import footprint

Command = Tuple[List[str], Dict[str, str]]


def child_env() -> Dict[str, str]:
    """This process's environment for a child: TensorFlow's C++ logs quiet, no inherited `TF_CONFIG`."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    env.pop("TF_CONFIG", None)
    return env


def worker_commands(
    base: List[str], env: Dict[str, str], workers: int, first_only: Sequence[str] = ()
) -> List[Command]:
    """`base` once per worker of a `MultiWorkerMirroredStrategy` cluster on localhost (each its `TF_CONFIG`);
    `first_only` is added to worker 0's arguments (where one worker writes the report)."""
    import portpicker

    addresses = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(workers)]
    return [
        (
            base + (list(first_only) if i == 0 else []),
            {
                **env,
                "TF_CONFIG": json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}}),
            },
        )
        for i in range(workers)
    ]


def run_together(commands: List[Command], timeout: float) -> List[Tuple[int, str]]:
    """Starts every command at once and waits for all; `(exit code, stderr)` each. Any still running after
    `timeout` seconds is killed."""
    return [(code, err) for code, _, err in run_together_output(commands, timeout)]


def run_together_output(commands: List[Command], timeout: float) -> List[Tuple[int, str, str]]:
    """`run_together`, keeping each command's standard output: `(exit code, stdout, stderr)` each."""
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c, e in commands]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def train_summary(flags: List[str], workers: int = 0, timeout: float = 3600.0) -> Dict:
    """`python -m tf_sharded train FLAGS` as a user runs it: one process, or `workers` processes of one
    MultiWorkerMirroredStrategy cluster (each its `TF_CONFIG`). The chief's samples/s, held-out AUC,
    summary line and `memory:` figures, and the CPU seconds of every process of the run (those it starts
    included: each waits for its own); RuntimeError with the end of its stderr if it fails."""
    command = [sys.executable, "-m", "tf_sharded", "train", *flags]
    commands = worker_commands(command, child_env(), workers) if workers else [(command, child_env())]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code, stdout, stderr = run_together_output(commands, timeout)[0]  # the chief's summary
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = [line for line in stdout.splitlines() if line.startswith("summary:")]
    if code != 0 or not summary:
        raise RuntimeError(f"train {' '.join(flags)} failed:\n{stderr[-3000:]}")
    rate = re.search(r"\| ([\d,]+) samples/s", summary[0])
    auc = re.search(r"AUC (\d\.\d+)", summary[0])
    found = {"samples_per_s": float(rate.group(1).replace(",", "")), "auc": float(auc.group(1)), "summary": summary[0],
             "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}  # fmt: skip
    found.update(footprint.parse(stdout) or {})
    return found
