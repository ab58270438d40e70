"""B13: hybrid training against the synchronous and the asynchronous strategies, on the application's data.

The DLRM application (`python -m tf_sharded train`, its synthetic
Criteo-shaped data, 26 tables) as a user runs it, at equal steps, with 2
workers (and 2 parameter servers where the strategy has them), a process
per task:

* `--strategy hybrid --num_workers 2 --num_ps 2`: tables on 2 table
  servers, updated by each worker; the dense layers all-reduced;
* `--strategy multi_worker` on 2 worker processes, the tables mirrored
  (`--placement device`) and sharded over the workers (`--placement
  sharded`): everything synchronous;
* `--strategy parameter_server --num_workers 2 --num_ps 2 --local_cluster
  process`: everything asynchronous.

Reported per run: samples/s and held-out AUC (the chief's summary line);
the chief's memory (its `memory:` line: peak resident, the variables it
holds, the tables and their slots); the CPU seconds of all the run's
processes per 1,000 samples (start-up, tracing and evaluation included);
then hybrid's samples/s over each other's, and the AUC differences. The
goals: hybrid at least 1.3x MultiWorkerMirrored's
samples/s, held-out AUC within 0.005 of the synchronous runs and at least
the parameter servers', and a hybrid worker holding at most 5% of the
tables' bytes (tables and slots) in variables.

    python -m tf_sharded bench hybrid [--quick]
"""

from __future__ import annotations

from typing import Dict, List

from tf_sharded.benchmarks import children

WORKERS, SERVERS = 2, 2
BATCH = 512  # the application's default global batch
# (label, the strategy's flags, whether its workers are started here as MultiWorkerMirrored processes)
RUNS = [
    ("hybrid", ["--strategy", "hybrid", "--num_workers", str(WORKERS), "--num_ps", str(SERVERS)], False),
    ("multi_worker_device", ["--strategy", "multi_worker", "--placement", "device"], True),
    ("multi_worker_sharded", ["--strategy", "multi_worker", "--placement", "sharded"], True),
    ("parameter_server", ["--strategy", "parameter_server", "--num_workers", str(WORKERS), "--num_ps",
                          str(SERVERS), "--local_cluster", "process"], False),
]  # fmt: skip
GOAL_SPEEDUP, GOAL_AUC, GOAL_WORKER_SHARE = 1.3, 0.005, 0.05


def _sizes(quick: bool) -> Dict:
    return {"steps": 20, "vocab": 1_000} if quick else {"steps": 600, "vocab": 100_000}


def _train(flags: List[str], workers: bool, sizes: Dict) -> Dict:
    """One application run; its chief's samples/s and held-out AUC."""
    common = ["--steps", str(sizes["steps"]), "--steps_per_epoch", str(sizes["steps"]), "--batch_size", str(BATCH),
              "--max_vocab", str(sizes["vocab"]), "--eval_steps", "8", "--verbose", "0"]  # fmt: skip
    return children.train_summary(common + flags, WORKERS if workers else 0)


def run(quick: bool = False) -> Dict:
    """Runs B13 (one application run per strategy, one after the other); returns the report."""
    sizes = _sizes(quick)
    runs = {label: _train(flags, workers, sizes) for label, flags, workers in RUNS}
    for r in runs.values():
        r["cpu_s_per_1000_samples"] = r["cpu_s"] / (sizes["steps"] * BATCH / 1000)
        r["held_share_of_tables"] = r["held_mib"] / r["tables_mib"]
    hybrid = runs["hybrid"]
    comparisons = {
        label: {
            "hybrid_vs_samples_per_s": hybrid["samples_per_s"] / r["samples_per_s"],
            "auc_difference": hybrid["auc"] - r["auc"],
        }
        for label, r in runs.items()
        if label != "hybrid"
    }
    synchronous = [comparisons[k] for k in ("multi_worker_device", "multi_worker_sharded")]
    return {
        "benchmark": "hybrid",
        "quick": quick,
        "workers": WORKERS,
        "servers": SERVERS,
        "steps": sizes["steps"],
        "max_vocab": sizes["vocab"],
        "runs": runs,
        "comparisons": comparisons,
        "goals": {
            "speedup_vs_multi_worker": min(c["hybrid_vs_samples_per_s"] for c in synchronous) >= GOAL_SPEEDUP,
            "auc_within_synchronous": max(abs(c["auc_difference"]) for c in synchronous) <= GOAL_AUC,
            "auc_at_least_parameter_server": comparisons["parameter_server"]["auc_difference"] >= 0,
            "worker_memory_share": hybrid["held_share_of_tables"] <= GOAL_WORKER_SHARE,
        },
    }


LABELS = {
    "hybrid": f"hybrid ({WORKERS} workers, {SERVERS} table servers)",
    "multi_worker_device": f"multi_worker, tables mirrored ({WORKERS} workers)",
    "multi_worker_sharded": f"multi_worker, tables sharded ({WORKERS} workers)",
    "parameter_server": f"parameter_server ({WORKERS} workers, {SERVERS} ps)",
}


def format_rows(report: Dict) -> List[str]:
    lines = [f"B13, the application, {report['steps']} steps (max vocabulary {report['max_vocab']:,}):"]
    for label, r in report["runs"].items():
        compared = report["comparisons"].get(label)
        extra = (
            f"; hybrid / this {compared['hybrid_vs_samples_per_s']:.2f}, AUC difference "
            f"{compared['auc_difference']:+.4f}"
            if compared
            else ""
        )
        lines.append(f"  {LABELS[label]}: {r['samples_per_s']:,.0f} samples/s, AUC {r['auc']:.4f}{extra}")
        lines.append(
            f"    CPU {r['cpu_s_per_1000_samples']:.2f} s per 1,000 samples; chief: peak resident "
            f"{r['peak_resident_mib']:,.0f} MiB, variables {r['held_mib']:,.1f} MiB = "
            f"{r['held_share_of_tables']:.1%} of the tables and slots' {r['tables_mib']:,.1f} MiB"
        )
    lines.append(f"  goals: {report['goals']}")
    return lines
