"""B14: what the tables' metrics cost the application: samples/s with `TableMetrics` reporting and without it.

The DLRM application (`python -m tf_sharded train`, its synthetic
Criteo-shaped data, 26 tables) as a user runs it, under parameter servers
(`--strategy parameter_server`: a local cluster of 2 ps and 2 workers in
one process) and under `--strategy mirrored`, each with the metrics
reported every 100 steps and written to a log directory (the default), and
with `--notable_metrics`. The runs of one strategy alternate (with,
without, without, with, ...), so that a drift of the machine's speed
weighs on both alike, and each side's figure is its median run.

Reported per strategy: the samples/s of each run (the application's
summary line), the medians, and `with / without`, the medians' ratio. The
goal: at least 0.97 (reporting every 100 steps costs at most 3%).

    python -m tf_sharded bench metrics [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Dict, List

from tf_sharded.benchmarks import children

BATCH = 512  # the application's default global batch
EVERY = 100
STRATEGIES = {
    "parameter_server": ["--strategy", "parameter_server"],
    "mirrored": ["--strategy", "mirrored"],
}
GOAL = 0.97


def _sizes(quick: bool) -> Dict:
    return {"steps": 40, "vocab": 1_000, "pairs": 1} if quick else {"steps": 1_000, "vocab": 100_000, "pairs": 2}


def _train(flags: List[str], sizes: Dict, metrics: bool) -> float:
    """One application run's samples/s; with metrics, written every `EVERY` steps to a fresh log directory."""
    common = ["--steps", str(sizes["steps"]), "--steps_per_epoch", str(sizes["steps"]), "--batch_size", str(BATCH),
              "--max_vocab", str(sizes["vocab"]), "--eval_steps", "2", "--verbose", "0"]  # fmt: skip
    with tempfile.TemporaryDirectory() as log_dir:
        extra = ["--metrics_every", str(EVERY), "--logdir", log_dir] if metrics else ["--notable_metrics"]
        return children.train_summary(common + flags + extra)["samples_per_s"]


def run(quick: bool = False) -> Dict:
    """Runs B14 (every run one after the other); returns the report."""
    sizes = _sizes(quick)
    results = {}
    for name, flags in STRATEGIES.items():
        runs = {True: [], False: []}
        for pair in range(sizes["pairs"]):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for metrics in order:
                runs[metrics].append(_train(flags, sizes, metrics))
        with_metrics, without = statistics.median(runs[True]), statistics.median(runs[False])
        results[name] = {
            "with_samples_per_s": runs[True],
            "without_samples_per_s": runs[False],
            "with_median": with_metrics,
            "without_median": without,
            "with_vs_without": with_metrics / without,
        }
    return {
        "benchmark": "metrics",
        "quick": quick,
        "steps": sizes["steps"],
        "max_vocab": sizes["vocab"],
        "every": EVERY,
        "results": results,
        "goals": {"at_most_3_percent_slower": all(r["with_vs_without"] >= GOAL for r in results.values())},
    }


def format_rows(report: Dict) -> List[str]:
    lines = [f"B14, the application, {report['steps']} steps, metrics every {report['every']} steps:"]
    for name, r in report["results"].items():
        lines.append(
            f"  {name}: with {r['with_median']:,.0f} samples/s, without {r['without_median']:,.0f}; "
            f"with / without {r['with_vs_without']:.3f}"
        )
    lines.append(f"  goals: {report['goals']}")
    return lines
