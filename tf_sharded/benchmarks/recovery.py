"""B8: recovery from a parameter-server failure inside `tfs.fit`, against restarting the program.

On a process-per-task cluster (2 ps + 1 worker, each task its own process,
restarted by the cluster when it dies), `fault_job` trains an embedding
table and a dense layer with `tfs.fit` (2 epochs of 150 steps of 64 ids,
Adagrad, a checkpoint every 50 steps), one run after another: uninterrupted,
then with ps:1 killed (SIGKILL) one second after training began. Reported
per kind of table (sharded; dynamic: two tables of raw int64 keys sharing row pools):

* `recovery_s`: from the kill to the first step completed after `tfs.fit`
  restored the latest checkpoint, in the same program;
* `wait_s` of it: until the killed task answered again (its process
  restarting: every way of recovering waits for it), and `resume_s`: from
  then to the first new step (reconnect, renew, restore, retrace);
* `steps_redone`: steps between that checkpoint and the failure;
* `restart_s`, the baseline for `resume_s`: what TensorFlow's guidance
  (restart the program from the checkpoint) costs at least, with the
  cluster's servers running. It is the uninterrupted run's time from
  launching the program to its first completed step (importing TensorFlow,
  connecting, building, tracing) less the time its local cluster took to
  start; a restarted program would also restore the checkpoint;
* `restart_vs_resume`: `restart_s / resume_s`;
* `max_weight_difference`: between each killed run's final weights and the
  uninterrupted run's (one worker reads the same batches in the same order:
  0 when the restore is exact), and every run's step count.

The full run kills 3 times per kind of table (medians); `--quick` once, and
only the sharded table.

    python -m tf_sharded bench recovery [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

KILL = "ps:1"


def _job(directory: str, name: str, flags: List[str]) -> Dict:
    """One `fault_job` run in its own process; its result with `launched` (when the process was started)."""
    path = os.path.join(directory, f"{name}.json")
    launched = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "tf_sharded.benchmarks.fault_job", path, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fault_job {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    with open(path) as f:
        result = json.load(f)
    result.update(launched=launched, stdout=proc.stdout)
    return result


def _difference(a: Dict, b: Dict) -> float:
    """The largest absolute difference between two runs' weights (inf when their names or shapes differ)."""
    worst = 0.0
    for name in a.keys() | b.keys():
        if name not in a or name not in b or np.shape(a[name]) != np.shape(b[name]):
            return float("inf")
        if np.size(a[name]):
            worst = max(worst, float(np.max(np.abs(np.asarray(a[name], float) - np.asarray(b[name], float)))))
    return worst


def _row(kind: str, whole: Dict, killed: List[Dict]) -> Dict:
    for run in killed:
        if len(run["recoveries"]) != 1:
            raise RuntimeError(f"{kind}: expected one recovery after killing {KILL}; got {run['recoveries']}")
    events = [run["recoveries"][0] for run in killed]
    recovery = [e["first_step_time"] - run["killed_at"] for e, run in zip(events, killed)]
    wait = [e["back_time"] - run["killed_at"] for e, run in zip(events, killed)]
    resume = [e["first_step_time"] - e["back_time"] for e in events]
    redone = [e["failed_at"] - e["restored"] for e in events]
    restart = whole["first_step_time"] - whole["launched"] - whole["cluster_start_s"]
    return {
        "table": kind,
        "kills": len(killed),
        "recovery_s": statistics.median(recovery),
        "recovery_s_each": recovery,
        "wait_s": statistics.median(wait),
        "resume_s": statistics.median(resume),
        "steps_redone": statistics.median(redone),
        "steps_redone_each": redone,
        "restart_s": restart,
        "restart_vs_resume": restart / statistics.median(resume),
        "cluster_start_s": whole["cluster_start_s"],
        "whole_wall_s": whole["end_time"] - whole["launched"],
        "killed_wall_s": statistics.median(run["end_time"] - run["launched"] for run in killed),
        "steps": [whole["steps"]] + [run["steps"] for run in killed],
        "iterations": [whole["iterations"]] + [run["iterations"] for run in killed],
        "max_weight_difference": max(_difference(run["weights"], whole["weights"]) for run in killed),
        "events": events,
        "restarts": [run["restarts"] for run in killed],
        "printed": [line for run in killed for line in run["stdout"].splitlines() if line.endswith("; resuming")],
    }


def run(quick: bool = False) -> Dict:
    kinds = [("sharded", [])] + ([] if quick else [("dynamic", ["--dynamic"])])
    kills = 1 if quick else 3
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for kind, flags in kinds:
            whole = _job(directory, f"{kind}_whole", flags)
            killed = [_job(directory, f"{kind}_killed_{i}", flags + ["--kill", KILL]) for i in range(kills)]
            results.append(_row(kind, whole, killed))
    return {"benchmark": "recovery", "quick": quick, "killed": KILL, "cluster": "2 ps + 1 worker, processes",
            "steps": 300, "checkpoint_every": 50, "results": results}  # fmt: skip


def format_rows(report: Dict) -> List[str]:
    rows = [f"B8 recovery: {report['killed']} killed once training began; {report['cluster']}, "
            f"{report['steps']} steps, a checkpoint every {report['checkpoint_every']}"]  # fmt: skip
    for r in report["results"]:
        rows.append(
            f"  {r['table']}: first new step {r['recovery_s']:.1f} s after the kill (median of {r['kills']}): "
            f"{r['wait_s']:.1f} s until the ps answered, then {r['resume_s']:.1f} s to resume; "
            f"{r['steps_redone']:.0f} steps redone; a program restart {r['restart_s']:.1f} s before its restore: "
            f"restart/resume {r['restart_vs_resume']:.2f}; weights off by {r['max_weight_difference']:.1e}"
        )
    return rows


if __name__ == "__main__":
    print("\n".join(format_rows(run(quick="--quick" in sys.argv))))
