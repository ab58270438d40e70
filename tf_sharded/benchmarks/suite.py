"""`python -m tf_sharded bench [NAME ...] [--quick] [--out DIR] [--mode inprocess|process|both]`.

Runs the named benchmarks (default: all), each in its own process (a
process holds one cluster, and a MirroredStrategy cannot share a process with
one), with its baseline in that same process run. Prints a table of figures
and ratios per benchmark and writes `DIR/NAME.json` and `DIR/NAME.png`.

`python -m tf_sharded bench report [--bench_dir DIR] [--out FILE] [--history FILE]`
runs nothing: it writes the results page (default `docs/benchmarks.md`, the
latest run of each benchmark per stack) and the page of the older runs beside
it from the JSON under DIR (default `docs/bench`), see
`tf_sharded.benchmarks.report`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from typing import Dict, List

from tf_sharded.benchmarks.catalog import BENCHMARKS, SINGLE_RUN


def _json_path(out: str, name: str, mode: str) -> str:
    """NAME.json for the in-process (or only) run, NAME_process.json for a process-per-task run."""
    suffix = "" if name in SINGLE_RUN or mode == "inprocess" else f"_{mode}"
    return os.path.join(out, f"{name}{suffix}.json")


# The parent's command line, handed to each benchmark's process so that its report names it.
COMMAND_ENV = "TF_SHARDED_BENCH_COMMAND"


def run_metadata(name: str, mode: str, quick: bool) -> Dict:
    """What produced a report, for the results page: the command, when, on what machine, with which releases
    and at which commit (None where it cannot be read, e.g. outside a git checkout)."""
    import datetime
    import platform

    import keras
    import numpy as np
    import tensorflow as tf

    def cpu_model():
        try:
            with open("/proc/cpuinfo") as f:
                return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        except OSError:
            return platform.processor() or None

    def commit():
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        except OSError:
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    fallback = f"python -m tf_sharded bench {name} --mode {mode}" + (" --quick" if quick else "")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": os.environ.get(COMMAND_ENV) or fallback,
        "commit": commit(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _child(name: str, quick: bool, mode: str, out: str) -> int:
    module = importlib.import_module(BENCHMARKS[name][0])
    kwargs = {"quick": quick}
    if name == "exchange":
        kwargs["out_dir"] = out
    elif name not in SINGLE_RUN:
        kwargs["mode"] = mode
    report = module.run(**kwargs)
    report["meta"] = run_metadata(name, mode, quick)
    with open(_json_path(out, name, mode), "w") as f:
        json.dump(report, f, indent=2)
    return 0


def _plot(name: str, reports: List[Dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(out, f"{name}.png")
    if name == "exchange":
        rows = [r for r in reports[0]["results"] if r["distribution"] == "power_law"]
        density = [r["density"] * 100 for r in rows]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for key, label in (
            ("allgather_s", "allgather"),
            ("dense_s", "dense"),
            ("auto_s", "auto"),
            ("allgather_collective_s", "allgather, collective transport"),
            ("tf_default_s", "TF default"),
            ("floor_s", "floor (lookup only)"),
        ):
            a.plot(density, [r[key] * 1e3 for r in rows], marker="o", label=label)
        for key, label in (("bytes_allgather", "allgather"), ("bytes_dense", "dense"), ("bytes_tf_default", "TF")):
            b.plot(density, [r[key] / 2**20 for r in rows], marker="o", label=label)
        a.set(xscale="log", xlabel="rows touched per step (%), power-law ids", ylabel="step time (ms)")
        b.set(xscale="log", yscale="log", xlabel="rows touched per step (%)", ylabel="MB per replica per step")
        a.legend()
        b.legend()
    elif name == "ps":
        from tf_sharded.benchmarks import ps_lookup

        fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4), squeeze=False)
        for ax, report in zip(axes[0], reports):
            variants = ["ours", "ours_unbatched", "tf_native", "keras", "limit", "dispatch"]
            variants += [v for v in ("tfra_per_feature", "tfra_one_table") if f"{v}_s" in report["results"][0]]
            multi = report["steps_per_execution_multi"]
            variants += [f"{v}_multi" for v in ps_lookup.MULTI if f"{v}_multi_s" in report["results"][0]]
            for i, r in enumerate(report["results"]):
                ax.bar(
                    [x + 0.4 * i for x in range(len(variants))],
                    [r[f"{v}_samples_per_s"] for v in variants],
                    width=0.4,
                    label=r["distribution"],
                )
            labels = [v.replace("_multi", f" x{multi}") for v in variants]
            ax.set_xticks([x + 0.2 for x in range(len(variants))], labels, rotation=30, ha="right")
            title = f"B1/B5, {report['mode']} cluster (xN: N steps a dispatch)"
            ax.set(yscale="log", ylabel="samples / s", title=title)
            ax.legend()
    elif name == "memory":
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = reports[0]["results"]
        labels = [f"{r['job']}:{r['task']}" for r in rows]
        ax.bar([x - 0.2 for x in range(len(rows))], [r["growth_mb"] for r in rows], width=0.4, label="RSS growth")
        ax.bar(
            [x + 0.2 for x in range(len(rows))],
            [r["expected_mb"] for r in rows],
            width=0.4,
            label="shards x (1 + slots)",
        )
        ax.set_xticks(range(len(rows)), labels)
        ax.set(ylabel="MB", title=f"B3: memory per task ({reports[0]['table_mb']:.0f} MB of tables)")
        ax.legend()
    elif name == "e2e":
        fig, ax = plt.subplots(figsize=(7, 4))
        rows = reports[0]["results"]
        x = range(len(rows))
        multi = reports[0]["steps_per_execution_multi"]
        for offset, key, label in (
            (-0.27, "keras_samples_per_s", "keras.layers.Embedding"),
            (0.0, "ours_samples_per_s", "tf_sharded"),
            (0.27, "ours_multi_samples_per_s", f"tf_sharded, steps_per_execution={multi}"),
        ):
            ax.bar([i + offset for i in x], [r[key] or 0 for r in rows], width=0.27, label=label)
        ax.axhline(reports[0]["input_samples_per_s"], color="gray", linestyle="--", label="input pipeline alone")
        ax.set_xticks(list(x), [r["strategy"] for r in rows])
        ax.set(yscale="log", ylabel="samples / s", title="B4: DLRM end to end")
        ax.legend()
    elif name == "dynamic":
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        labels = [r["mode"] for r in reports]
        bars = [("static_s", "static table, ids"), ("dynamic_s", "dynamic, raw keys")]
        bars += [("static_collection_s", "static, one collection"), ("dynamic_collection_s", "dynamic, collection")]
        if all("tfra_one_table_s" in r["results"][0] for r in reports):
            bars += [("tfra_per_feature_s", "TFRA, table per feature"), ("tfra_one_table_s", "TFRA, one table")]
        width = 0.8 / len(bars)
        for j, (key, label) in enumerate(bars):
            offset = (j - (len(bars) - 1) / 2) * width
            a.bar([i + offset for i in range(len(reports))], [r["results"][0][key] * 1e3 for r in reports], width,
                  label=label)  # fmt: skip
        a.set_xticks(range(len(reports)), labels)
        a.set(ylabel="ms / step", title=f"B7: {reports[0]['features']} features, lookup + Adagrad")
        a.legend(fontsize=8, loc="upper left")
        m, p = reports[0]["memory"], reports[0]["memory_ps_env"]
        b.bar(["TF defaults", "ps settings", "pools", "bound"],
              [m["max_bytes_per_key"], p["max_bytes_per_key"], p["pool_bytes_per_key"], m["bound_bytes"]])  # fmt: skip
        b.set(ylabel="bytes per live key (largest reading)", title=f"memory, up to {m['keys']:,} keys")
    elif name == "dynamic_churn":
        fig, ax = plt.subplots(figsize=(7, 4))
        for report in reports:
            r = report["results"][0]
            tenths = range(1, len(r["churn_tenths_s"]) + 1)
            for key, label in (("churn_tenths_s", "capacity-bounded"), ("baseline_tenths_s", "without eviction")):
                ax.plot(tenths, [t * 1e3 for t in r[key]], marker="o", label=f"{label} ({report['mode']})")
        title = f"B7 churn: {reports[0]['inserted_keys']:,} new keys, capacity {reports[0]['capacity']:,}"
        ax.set(xlabel="tenth of the run", ylabel="median ms / step", ylim=(0, None), title=title)
        ax.legend(fontsize=8)
    elif name == "recovery":
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = reports[0]["results"]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["wait_s"] for r in rows], width=0.4, label="until the ps answers")
        ax.bar([i - 0.2 for i in x], [r["resume_s"] for r in rows], width=0.4, bottom=[r["wait_s"] for r in rows],
               label="tfs.fit: reconnect, restore, first step")  # fmt: skip
        ax.bar([i + 0.2 for i in x], [r["restart_s"] for r in rows], width=0.4, label="program restart, no restore")
        ax.set_xticks(list(x), [r["table"] for r in rows])
        ax.set(ylabel="seconds", title=f"B8: {reports[0]['killed']} killed, time to the first new step")
        ax.set_ylim(0, 1.5 * max(max(r["recovery_s"], r["restart_s"]) for r in rows))
        ax.legend(fontsize=8, loc="upper left")
    elif name == "mwprofile":
        fig, ax = plt.subplots(figsize=(7, 4))
        r = reports[0]
        bars = [
            ("step (2 workers)", r["step_ms"]),
            (f"{r['collective_count']} rendezvous\nx scalar latency", r["rendezvous_floor_ms"]),
            ("dense grads\nall-reduce", r["dense_all_reduce_ms"]),
            ("embedding grads\nall-gather", r["sparse_all_gather_ms"]),
            ("compute, 256 ex.\none thread", r["compute_one_thread_ms"]),
            ("compute, 256 ex.\nboth cores", r["compute_all_cores_ms"]),
        ]
        ax.bar(range(len(bars)), [v for _, v in bars])
        ax.set_xticks(range(len(bars)), [k for k, _ in bars], fontsize=7)
        ax.set(ylabel="ms", title="B10: a multi-worker mirrored step and its parts")
    elif name == "plan":
        fig, axes = plt.subplots(1, len(reports), figsize=(7 * len(reports), 4), squeeze=False)
        for ax, report in zip(axes[0], reports):
            rows = report["results"]
            labels = [r.get("point") or f"{r['rows']:,} rows\n{r['ids_per_replica']}/replica" for r in rows]
            ax.bar(range(len(rows)), [r["chosen_vs_fastest"] for r in rows],
                   color=["tab:green" if r["agrees"] else "tab:red" for r in rows])  # fmt: skip
            ax.axhline(1 + report["noise"], color="gray", linestyle="--", label="noise")
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            ax.set(ylabel="plan's option / fastest option", title=f"B11: tfs.plan's choices ({report['mode']})")
            ax.legend()
    elif name == "sharded":
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        tables = reports[0]["tables"]
        for per in reports[0]["results"]:
            label = f"{per['workers']} workers" if per.get("workers") else f"{per['replicas']} replicas"
            # Lines over the table sizes at the usual number of tables; other numbers of tables as labelled points.
            rows = [r for r in per["results"] if r.get("tables", tables) == tables]
            others = [r for r in per["results"] if r.get("tables", tables) != tables]
            a.plot([r["rows"] for r in rows], [r["sharded_vs_even_share"] for r in rows], marker="o", label=label)
            line = b.plot([r["rows"] for r in rows], [r["sharded_vs_device_step"] for r in rows], marker="o",
                          label=f"{label}, {tables} tables")[0]  # fmt: skip
            for r in others:
                b.plot([r["rows"]], [r["sharded_vs_device_step"]], marker="s", color=line.get_color())
                b.annotate(f"{r['tables']} tables", (r["rows"], r["sharded_vs_device_step"]), fontsize=7,
                           xytext=(4, 0), textcoords="offset points")  # fmt: skip
            if any("sharded_gather_step_s" in r for r in rows):
                b.plot([r["rows"] for r in rows], [r["sharded_gather_step_s"] / r["device_step_s"] for r in rows],
                       marker="x", linestyle=":", color=line.get_color(),
                       label=f"{label}, {tables} tables, gather transport")  # fmt: skip
        a.axhline(1.15, color="gray", linestyle="--", label="goal (1.15)")
        a.set(xscale="log", xlabel="rows per table", ylabel="bytes per replica / even share", title="B12: memory")
        b.axhline(1.0, color="gray", linestyle="--")
        b.set(xscale="log", xlabel="rows per table", ylabel="step time, sharded / device copies", title="B12: step")
        a.legend()
        b.legend()
    elif name == "hybrid":
        from tf_sharded.benchmarks.hybrid import LABELS

        runs = reports[0]["runs"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        names = [LABELS[k].replace(" (", "\n(") for k in runs]
        a.bar(range(len(runs)), [r["samples_per_s"] for r in runs.values()])
        a.set_xticks(range(len(runs)), names, fontsize=7)
        a.set(ylabel="samples/s", title=f"B13: the application, {reports[0]['steps']} steps")
        b.bar(range(len(runs)), [r["auc"] for r in runs.values()])
        b.set_xticks(range(len(runs)), names, fontsize=7)
        b.set(ylim=(0.5, 1.0), ylabel="held-out AUC")
    elif name == "metrics":
        fig, ax = plt.subplots(figsize=(6, 4))
        results = reports[0]["results"]
        for i, r in enumerate(results.values()):
            sides = ((-0.2, "with_samples_per_s", "TableMetrics"), (0.2, "without_samples_per_s", "without"))
            for offset, key, label in sides:
                ax.scatter([i + offset] * len(r[key]), r[key], color="tab:orange" if offset < 0 else "tab:blue",
                           label=label if i == 0 else None)  # fmt: skip
            ax.annotate(f"{r['with_vs_without']:.3f}", (i, max(r["without_samples_per_s"] + r["with_samples_per_s"])),
                        ha="center", xytext=(0, 6), textcoords="offset points")  # fmt: skip
        ax.set_xticks(range(len(results)), list(results))
        top = max(max(r["with_samples_per_s"] + r["without_samples_per_s"]) for r in results.values())
        ax.set(ylabel="samples/s (each run)", ylim=(0, 1.15 * top),
               title=f"B14: metrics every {reports[0]['every']} steps (with / without)")  # fmt: skip
        ax.legend(fontsize=8, loc="lower right")
    elif name == "quantize":
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4))
        rows = reports[0]["results"]
        a.bar([r["export"] for r in rows], [r["table_bytes"] / 2**20 for r in rows])
        a.set(ylabel="MB of tables", title="B9: tables in the SavedModel")
        b.bar([r["export"] for r in rows], [r["auc"] for r in rows])
        changes = ", ".join(f"{r['export']} {r['auc_change']:+.4f}" for r in rows[1:])
        b.set(ylim=(0.5, 1.0), ylabel="held-out AUC", title=f"AUC change: {changes}")
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        for report in reports:
            rows = report["results"]
            for key, label in (("collection_s", "EmbeddingCollection"), ("per_table_s", "one layer per table")):
                ax.plot(
                    [r["tables"] for r in rows],
                    [r[key] * 1e3 for r in rows],
                    marker="o",
                    label=f"{label} ({report['mode']})",
                )
        ax.set(xscale="log", xlabel="tables", ylabel="step time (ms)", title="B6: fused lookups")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:  # the results page from JSON already written: no benchmark runs
        from tf_sharded.benchmarks import report

        return report.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tf_sharded bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "names",
        nargs="*",
        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}; or `report [--bench_dir DIR] [--out "
        "FILE]` alone: the results page from their JSON",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests): checks the JSON, not speed")
    parser.add_argument("--out", default="bench_results", help="directory for NAME.json and NAME.png")
    parser.add_argument(
        "--mode",
        default="inprocess",
        choices=["inprocess", "process", "both"],
        help="cluster of the ps/fused benchmarks: in-process servers or one process per task",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        return _child(args.child, args.quick, args.mode, args.out)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)
    modes = ["inprocess", "process"] if args.mode == "both" else [args.mode]
    status = 0
    for name in names:
        print(f"== {name}: {BENCHMARKS[name][1]}", flush=True)
        reports = []
        for mode in modes if name not in SINGLE_RUN else ["inprocess"]:
            child = [
                sys.executable,
                "-m",
                "tf_sharded.benchmarks.suite",
                "--child",
                name,
                "--mode",
                mode,
                "--out",
                args.out,
            ] + (["--quick"] if args.quick else [])
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   COMMAND_ENV: " ".join(["python -m tf_sharded bench", *argv])}  # fmt: skip
            proc = subprocess.run(child, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} ({mode}) failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
                status = 1
                continue
            with open(_json_path(args.out, name, mode)) as f:
                reports.append(json.load(f))
            module = importlib.import_module(BENCHMARKS[name][0])
            print("\n".join(module.format_rows(reports[-1])), flush=True)
        if reports:
            print(f"wrote {_plot(name, reports, args.out)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
