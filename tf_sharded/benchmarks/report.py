"""`python -m tf_sharded bench report [--bench_dir DIR] [--out FILE] [--history FILE]`: the results pages.

Reads every `*.json` under the bench directory (default `docs/bench`, subdirectories included) and writes
two Markdown pages: the results page (default `docs/benchmarks.md`), with the latest run of each benchmark
on each stack, and beside it the page of the older runs (`benchmarks-history.md`). Both have a section per
benchmark of the suite, in the order of their ids (B1 ... B13); the results page opens with an index of the
runs it shows and links each section to the same section of the older runs.

A run is the reports of one benchmark in one directory from one stack (`--mode both` writes `NAME.json` and
`NAME_process.json` in one run). Its stack is the TensorFlow major.minor its reports' `meta.tensorflow`
records, else the `tfX.Y` its directory's name begins with (`tf2.21/`), else `UNRECORDED_STACK` (TF 2.16:
every run from before the reports recorded versions was on it). The latest run of a benchmark on a stack
is the one whose reports record the latest `meta.date`; a run recording no date is older than one that
does (the suite records it with every run), and among runs recording none the latest lies in the directory
that sorts last, the bench directory's own files first. Each run gives a block per JSON file: the command
that writes such a file, the run's date, machine, library versions and commit where the file records them
("not recorded" where it does not), the workload, tables of the figures and ratios; then the suite's plot
`NAME.png` when one lies beside the files. Files that are not reports of the suite's benchmarks are listed
at the end of the results page, unrendered.

The pages are a function of the files alone: sorted file order, paths and links relative to each page, no
clock, host or git read while writing (a file's git date would change the page between writing a report
and committing it, and a copy of the directory has none). Regenerating them from the same files gives the
same bytes, which is what lets a test hold the committed pages to the committed JSON.

What a report says about its run is read from a `meta` object when it has one: `date`, `command`,
`commit`, `cpu` (the CPU model), `cores`, `memory_bytes`, `tensorflow`, `keras`, `numpy`, `python`.
B1's reports also record `cores` at the top level (the cores the process may use). The command is
otherwise rebuilt from what every report records: the benchmark's name, its cluster `mode` and `quick`.

This module imports the standard library and the suite's list of benchmarks only: no benchmark module,
NumPy or matplotlib (plots are linked, not drawn), so the page is written in seconds on any machine that
has the package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from tf_sharded.benchmarks.catalog import BENCHMARKS, SINGLE_RUN
from tf_sharded.benchmarks.sharded import app_label, replicas_label

NOT_RECORDED = "not recorded"

READING = """\
How to read the ratios (each benchmark's module docstring, `tf_sharded/benchmarks/`, defines its own):

* **B1 + B5** (`bench ps`): step times are medians of interleaved rounds on the same batches.
  `X / ours` is X's step time over ours: above 1, ours is faster. `ours / limit` is the local limit's time
  over ours: the share of the one-process, undistributed limit that ours reaches. `dispatch / ours` is the
  share of our step that a step doing nothing but scheduling one read per variable costs. TFRA's ratios
  use its faster layout. `xN`: N steps in one scheduled function, times per step. Overlap probe:
  `sync / pipelined` and `sync / stale` above 1 mean overlapping steps would shorten the step.
* **B2** (`bench exchange`): `TF / auto` is TensorFlow's default exchange's step time over `auto` (above 1,
  ours is faster); `auto / best` is `auto` over the faster of `allgather` and `dense` (1: it chose well);
  `TF / floor` is TensorFlow's default over the lookup-only step, the most any exchange could gain here;
  `noise` is a second, identical `allgather` table over the first; `collective / allgather` is the
  collective transport over the in-process one. Bytes are those one replica receives per step.
* **B3** (`bench memory`): `growth / expected` is a process's resident-memory growth over the bytes it
  should hold (a ps: its shards x (1 + slots), target within 15%; mirrored `host`: one copy, `device`: one
  per replica); a worker's `growth / table bytes`, target at most 0.05; `peak / held`, a ps's peak while a
  checkpoint is written over the bytes it holds, target at most 0.10.
* **B4** (`bench e2e`): ratios of samples/s: `ours / keras` above 1, ours is faster; `ours / input` is the
  share of the input pipeline's own rate; `xN / ours` is what N steps per execution gain.
* **B6** (`bench fused`): `per table / collection` is the step time of one layer per table over one
  `EmbeddingCollection`: above 1, the collection is faster.
* **B7** (`bench dynamic`): `dynamic / static` is the step time on raw keys over the static table's on the
  same ids (goal at most 1.5); `ours / TFRA` is throughput, TFRA's step time over ours, the faster layout
  of each (goal at least 1.5); `/ bound` is the largest reading of bytes per live key over
  1.3 x (dim x 4 x (1 + slots) + key and metadata bytes): at most 1 meets it.
* **B7 churn** (`bench dynamic_churn`): `last / first` is the median step of the run's last tenth over its
  first (1: no slow-down as keys come and go); `churned / baseline` is the bounded table's step over the same
  table's without eviction on the same batches; bytes per live key are those its pools and index hold.
* **B8** (`bench recovery`): `restart / resume` is a program restart (before any restore) over resuming
  inside `tfs.fit` once the ps answers: above 1, resuming is faster.
* **B9** (`bench quantize`): changes are quantized minus float; `float / this` is the float tables' bytes
  over this export's.
* **B10** (`bench mwprofile`): no ratios: milliseconds of a multi-worker step and of its parts, each
  measured alone.
* **B11** (`bench plan`): `chosen / fastest` is the step time of the plan's option over the fastest
  option's: 1.00, the plan chose the fastest; it agrees within 1 + the report's noise.
* **B12** (`bench sharded`): `/ even share` is the bytes of tables and slots on the fullest replica over
  (tables + slots) / replicas (goal at most 1.15); `sharded / device` is the step time of tables sharded
  over the replicas over that of a copy per replica: above 1, copies are faster where both fit. `chosen /
  gather` is the sharded step over the transport the cost model chose over the gather form's: below 1, the
  choice is faster. `chosen / fastest` is the step time of the placement `tfs.plan` picks from the point's
  ids over the faster one's.
* **B13** (`bench hybrid`): `hybrid / this` is hybrid training's samples/s over this strategy's (goal at
  least 1.3 against the multi-worker mirrored runs); AUC differences are hybrid's minus this run's (goal
  within 0.005 of the synchronous runs, and at least 0 against the parameter servers').
* **B14** (`bench metrics`): `with / without` is the median samples/s of the application's runs with
  `TableMetrics` reporting every 100 steps over that of its runs without (goal at least 0.97)."""


class ReportError(Exception):
    """Input the page cannot be written from; its message is one line naming the flag or file."""


# ---------------------------------------------------------------------------------------------------- cells


def _cell(value, spec: str = "") -> str:
    """One table cell: `value` formatted with `spec`; `n/a` for a figure the run did not produce."""
    if value is None:
        return "n/a"
    return format(value, spec) if spec else str(value)


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


# A cell that is a figure: right-aligned, as a column of them reads best.
_FIGURE = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]\d+)?%?( \(.*\))?|n/a")


def _table(header: str, rows: Iterable[Sequence[str]]) -> List[str]:
    """A Markdown table under `header` (its columns separated by " | "): a column whose every cell is a figure
    right-aligned, any other left-aligned."""
    columns, rows = header.split(" | "), [list(row) for row in rows]
    figures = [all(_FIGURE.fullmatch(row[i]) for row in rows) if rows else False for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" ---: " if f else " --- " for f in figures) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _para(text: str) -> List[str]:
    return [text, ""]


# ----------------------------------------------------------------------------------------------- benchmarks


def _ps(report: Dict) -> List[str]:
    rows, n = report["results"], report["steps_per_execution_multi"]
    peers = "tfra_vs_ours" in rows[0]
    tfra_times = " | TFRA per feature | TFRA one table" if peers else ""
    tfra_ratio = " | TFRA / ours" if peers else ""
    lines = _para(
        f"Workload: {report['features']} tables, {report['table_rows']:,} rows x {report['dim']} in all (each "
        f"capped at {report['max_vocab']:,} rows), a batch of {report['batch']} ids per table; {report['rounds']} "
        f"rounds of {report['steps_per_round']} steps (`x{n}`: {report['multi_steps_per_round']} steps a round, "
        f"{n} per scheduled function). TFRA: {report['tfra']}."
    )
    lines += _para("Median step time (ms) and our throughput:")
    lines += _table(
        f"ids | ours | ours, unbatched | tf_native | keras | limit | dispatch{tfra_times} | ours samples/s",
        (
            [r["distribution"]]
            + [_ms(r[f"{v}_s"]) for v in ("ours", "ours_unbatched", "tf_native", "keras", "limit", "dispatch")]
            + ([_ms(r["tfra_per_feature_s"]), _ms(r["tfra_one_table_s"])] if peers else [])
            + [_cell(r["ours_samples_per_s"], ",.0f")]
            for r in rows
        ),
    )
    lines += _para("Ratios:")
    lines += _table(
        f"ids | tf_native / ours | keras / ours | unbatched / ours{tfra_ratio} | ours / limit | dispatch / ours",
        (
            [r["distribution"]]
            + [_cell(r[k], ".2f") for k in ("tf_native_vs_ours", "keras_vs_ours", "unbatched_vs_ours")]
            + ([_cell(r["tfra_vs_ours"], ".2f")] if peers else [])
            + [_cell(r["ours_vs_limit"], ".2f"), _cell(r["dispatch_share_of_ours"], ".2f")]
            for r in rows
        ),
    )
    lines += _para(f"`x{n}`: {n} steps per scheduled function, per step (ms) and ratios:")
    lines += _table(
        f"ids | ours | tf_native | dispatch{tfra_times} | tf_native / ours{tfra_ratio} | ours / limit | "
        "dispatch / ours",
        (
            [r["distribution"]]
            + [_ms(r[f"{v}_multi_s"]) for v in ("ours", "tf_native", "dispatch")]
            + ([_ms(r["tfra_per_feature_multi_s"]), _ms(r["tfra_one_table_multi_s"])] if peers else [])
            + [_cell(r["tf_native_vs_ours_multi"], ".2f")]
            + ([_cell(r["tfra_vs_ours_multi"], ".2f")] if peers else [])
            + [_cell(r["ours_multi_vs_limit"], ".2f"), _cell(r["dispatch_share_of_ours_multi"], ".2f")]
            for r in rows
        ),
    )
    lines += _para(f"Overlap probe, plain variables, `x{n}` (ms per step):")
    lines += _table(
        "ids | sync | pipelined | stale by one | sync / pipelined | sync / stale",
        (
            [r["distribution"]]
            + [_ms(r[f"overlap_{v}_multi_s"]) for v in ("sync", "pipelined", "stale")]
            + [_cell(r["overlap_pipelined_speedup"], ".2f"), _cell(r["overlap_stale_speedup"], ".2f")]
            for r in rows
        ),
    )
    if "tfra_vs_dispatch" in rows[0]:
        reach = ("tfra_vs_dispatch", "tfra_vs_dispatch_multi", "tfra_vs_lean_loop_multi")
        lines += _para("Reach of the targets: TFRA's faster layout over the floors of the same run:")
        lines += _table(
            f"ids | TFRA / dispatch | TFRA / dispatch, x{n} | TFRA / lean loop, x{n}",
            ([r["distribution"]] + [_cell(r[k], ".2f") for k in reach] for r in rows),
        )
    return lines + _ps_cpu(report) + _ps_agreement(report)


def _ps_cpu(report: Dict) -> List[str]:
    shown = ("ours", "tf_native", "tfra_one_table", "dispatch", "ours_multi", "dispatch_multi")
    table = []
    for r in report["results"]:
        for name in (v for v in shown if v in r["cpu_ms_per_step"]):
            spent = r["cpu_ms_per_step"][name]
            parts = ", ".join(f"{where} {ms:.1f}" for where, ms in spent.items() if where != "total")
            table.append([r["distribution"], name, f"{spent['total']:.1f}", parts, f"{r['cpu_busy'][name]:.2f}"])
    cores = report.get("cores")
    busy = f"share of {cores} cores busy" if cores else "share of the cores busy"
    return _para("CPU time per step (ms), by process:") + _table(f"ids | variant | total | by process | {busy}", table)


def _ps_agreement(report: Dict) -> List[str]:
    check, looped, overlap = report["agreement"], report["agreement_multi"], report["agreement_overlap"]
    concurrent = report.get("concurrency") or {}
    variants = [k for k in check if k != "reference_moved"]
    variants += [k for k in concurrent if isinstance(concurrent[k], dict) and k not in variants]
    head = "variant | 3 steps | 3 steps in one function"
    text = (
        f"Agreement: largest row difference from a local reference after 3 steps from the same start (the "
        f"reference moved {check['reference_moved']:.1e})"
    )
    if concurrent:
        head += f" | {concurrent['steps']} steps on {concurrent['workers']} workers at once | rows beyond the bound"
        text += (
            f"; and after {concurrent['steps']} steps on {concurrent['workers']} workers at once against the same "
            f"steps in order (reference moved {concurrent['reference_moved']:.1e}, stale-read bound "
            f"{concurrent['drift_bound']:.1e})"
        )
    table = []
    for name in variants:
        row = [name, _cell(check.get(name), ".1e"), _cell(looped.get(name), ".1e")]
        c = concurrent.get(name)
        if c:
            row += [f"{c['max_difference']:.1e}", f"{c['rows_off']:.1%}" + ("" if c["within"] else " (beyond)")]
        elif concurrent:
            row += ["n/a", "n/a"]
        table.append(row)
    return (
        _para(text + ":")
        + _table(head, table)
        + _para(
            f"Overlap probe after 3 steps: sync against a local reference {overlap['sync']:.1e}, pipelined "
            f"against sync {overlap['pipelined_vs_sync']:.1e}, stale by one against sync "
            f"{overlap['stale_vs_sync']:.1e} (reference moved {overlap['reference_moved']:.1e})."
        )
    )


def _exchange(report: Dict) -> List[str]:
    rows, mb = report["results"], 1 / (1 << 20)
    modes = ("allgather", "dense", "auto", "tf_default", "floor", "allgather_collective")
    ratios = ("auto_vs_best", "tf_default_vs_auto", "tf_default_vs_floor", "noise", "collective_vs_allgather")
    lines = _para(
        f"Workload: a table of {report['rows']:,} x {report['dim']} on {report['replicas']} replicas, "
        f"{report['steps']} steps per point."
    )
    lines += _para("Median step time (ms):")
    lines += _table(
        "ids | density | ids / replica | distinct | allgather | dense | auto | TF default | floor | "
        "allgather, collective",
        (
            [r["distribution"], f"{r['density']:.0e}", f"{r['ids_per_replica']:,}"]
            + [f"{r['max_distinct_per_replica']:,}"]
            + [_ms(r[f"{k}_s"]) for k in modes]
            for r in rows
        ),
    )
    lines += _para("Ratios, and MB one replica receives per step:")
    return lines + _table(
        "ids | density | auto chose | auto / best | TF / auto | TF / floor | noise | collective / allgather | "
        "MB allgather | MB dense | MB TF",
        (
            [r["distribution"], f"{r['density']:.0e}", r["auto_chose"]]
            + [_cell(r[k], ".2f") for k in ratios]
            + [f"{r[k] * mb:.2f}" for k in ("bytes_allgather", "bytes_dense", "bytes_tf_default")]
            for r in rows
        ),
    )


def _memory(report: Dict) -> List[str]:
    lines = _para(
        f"Workload: {report['table_mb']:,.0f} MB of tables, {report['slots_per_table']} slot per table; tables and "
        f"slots created in {report['creation_s']:.1f} s."
    )
    lines += _para("Parameter servers, one process per task (MB):")
    lines += _table(
        "task | RSS before | after | growth | expected | growth / expected | growth / table bytes | "
        "checkpoint peak | peak / held",
        (
            [f"{r['job']}:{r['task']}"]
            + [f"{r[k]:,.0f}" for k in ("rss_before_mb", "rss_after_mb", "growth_mb", "expected_mb")]
            + [_cell(r.get("growth_vs_expected"), ".3f"), _cell(r.get("growth_vs_table_bytes"), ".3f")]
            + [f"{r['checkpoint_peak_mb']:,.1f}", _cell(r.get("checkpoint_peak_vs_held"), ".3f")]
            for r in report["results"]
        ),
    )
    if report.get("mirrored"):
        sizes = ("table_mb", "rss_before_mb", "rss_created_mb", "rss_after_mb", "growth_mb", "expected_mb")
        lines += _para("Mirrored, one process per placement (MB):")
        lines += _table(
            "placement | replicas | tables | RSS before | tables created | after steps | growth | expected | "
            "growth / expected | steps' growth",
            (
                [r["placement"], str(r["replicas"])]
                + [f"{r[k]:,.0f}" for k in sizes]
                + [f"{r['growth_vs_expected']:.3f}", f"{r['steps_growth_mb']:,.0f}"]
                for r in report["mirrored"]
            ),
        )
    return lines


def _e2e(report: Dict) -> List[str]:
    n = report["steps_per_execution_multi"]
    rates = ("ours_samples_per_s", "keras_samples_per_s", "ours_multi_samples_per_s")
    lines = _para(
        f"Workload: {report['model'].upper()}, batch {report['batch']}, {report['tables']} tables capped at "
        f"{report['max_vocab']:,} rows, {report['timed_epochs']} timed epochs of {report['steps_per_epoch']} steps "
        f"(median); the input pipeline alone: {report['input_samples_per_s']:,.0f} samples/s."
    )
    lines += _table(
        f"strategy | replicas | ours samples/s | keras samples/s | ours x{n} samples/s | ours / keras | "
        f"ours / input | x{n} / ours | final loss, ours | final loss, keras",
        (
            [r["strategy"], str(r["replicas"])]
            + [_cell(r[k], ",.0f") for k in rates]
            + [_cell(r[k], ".2f") for k in ("ours_vs_keras", "ours_vs_input", "ours_multi_vs_ours")]
            + [_cell(r.get("ours_final_loss"), ".4f"), _cell(r.get("keras_final_loss"), ".4f")]
            for r in report["results"]
        ),
    )
    for r in report["results"]:
        if r.get("keras_error"):
            lines += _para(f"keras under `{r['strategy']}`: {' '.join(str(r['keras_error']).split())}")
    return lines


def _fused(report: Dict) -> List[str]:
    lines = _para(
        f"Workload: tables of {report['rows']:,} x {report['dim']}, a batch of {report['batch']} ids per table."
    )
    return lines + _table(
        "tables | collection (ms) | per table (ms) | per table / collection",
        (
            [str(r["tables"]), _ms(r["collection_s"]), _ms(r["per_table_s"]), f"{r['per_table_vs_collection']:.2f}"]
            for r in report["results"]
        ),
    )


def _dynamic(report: Dict) -> List[str]:
    r, m, p = report["results"][0], report["memory"], report["memory_ps_env"]
    lines = _para(
        f"Workload: {report['features']} features x {report['batch']} power-law keys, dim {report['dim']}, static "
        f"tables of {report['rows']:,} rows; {r['live_keys']:,} live keys after the run; inserts "
        f"{r['insert_keys_per_s']:,.0f} new keys/s. TFRA: {report['tfra']}."
    )
    lines += _table(
        "layout | static (ms) | dynamic (ms) | dynamic / static",
        [
            ["one lookup per table", _ms(r["static_s"]), _ms(r["dynamic_s"]), f"{r['dynamic_vs_static']:.2f}"],
            ["one EmbeddingCollection", _ms(r["static_collection_s"]), _ms(r["dynamic_collection_s"])]
            + [f"{r['collection_dynamic_vs_static']:.2f}"],
        ],
    )
    if "ours_vs_tfra" in r:
        lines += _table(
            "TFRA per feature (ms) | TFRA one table (ms) | ours / TFRA | TFRA / our static collection | "
            "rows differ by at most",
            [
                [_ms(r["tfra_per_feature_s"]), _ms(r["tfra_one_table_s"]), f"{r['ours_vs_tfra']:.2f}"]
                + [f"{r['tfra_vs_static_collection']:.2f}", f"{r['tfra_max_row_difference']:.1e}"]
            ],
        )
    settings = " ".join(f"{k}={v}" for k, v in p.get("env", {}).items())
    read_at = ", ".join(f"{q['keys']:,}" for q in m["points"])
    lines += _para(f"Resident memory per live key (bytes), read at {read_at} keys:")
    return lines + _table(
        "settings | at most | at the end | pools | bound | at most / bound",
        (
            [label]
            + [f"{x[k]:.0f}" for k in ("max_bytes_per_key", "bytes_per_key", "pool_bytes_per_key", "bound_bytes")]
            + [f"{x['per_key_vs_bound']:.2f}"]
            for label, x in (("TensorFlow's defaults", m), (f"parameter-server settings (`{settings}`)", p))
        ),
    )


def _recovery(report: Dict) -> List[str]:
    lines = _para(
        f"Workload: {report['killed']} killed once training began; {report['cluster']}, {report['steps']} steps, a "
        f"checkpoint every {report['checkpoint_every']}. Seconds are medians over the kills."
    )
    return lines + _table(
        "table | kills | kill to first new step (s) | until the ps answered (s) | then resuming (s) | steps redone | "
        "program restart (s) | restart / resume | weights off by",
        (
            [r["table"], str(r["kills"])]
            + [f"{r[k]:.2f}" for k in ("recovery_s", "wait_s", "resume_s")]
            + [f"{r['steps_redone']:.0f}", f"{r['restart_s']:.2f}", f"{r['restart_vs_resume']:.2f}"]
            + [f"{r['max_weight_difference']:.1e}"]
            for r in report["results"]
        ),
    )


def _quantize(report: Dict) -> List[str]:
    lines = _para(
        f"Workload: {report['model'].upper()} trained {report['steps']} steps, tables capped at "
        f"{report['max_vocab']:,} rows x {report['embedding_dim']}; {report['held_out_examples']:,} held-out examples."
    )
    return lines + _table(
        "export | AUC | log-loss | tables (MB) | AUC change | log-loss change | largest logit change | float / this",
        (
            [r["export"], f"{r['auc']:.4f}", f"{r['logloss']:.4f}", f"{r['table_bytes'] / 2**20:.2f}"]
            + [_cell(r.get("auc_change"), "+.2e"), _cell(r.get("logloss_change"), "+.2e")]
            + [_cell(r.get("max_abs_logit_change"), ".4f"), _cell(r.get("table_bytes_ratio"), ".2f")]
            for r in report["results"]
        ),
    )


def _mwprofile(report: Dict) -> List[str]:
    ops = ", ".join(f"{n} {op}" for op, n in sorted(report["collectives"].items()))
    lines = _para(
        f"Workload: DLRM, {report['tables']} tables capped at {report['max_vocab']:,} rows, {report['workers']} "
        f"worker processes, global batch {report['global_batch']}; {report['samples_per_s']:,.0f} samples/s. "
        f"Collectives in the step: {ops}."
    )
    parts = [
        (f"the step, {report['workers']} workers", "step_ms"),
        ("a scalar all-reduce alone", "scalar_all_reduce_ms"),
        (f"{report['collective_count']} rendezvous x the scalar latency", "rendezvous_floor_ms"),
        (f"dense gradients all-reduce ({report['dense_parameters']:,} floats)", "dense_all_reduce_ms"),
        (f"embedding gradients all-gather ({report['gathered_rows']:,} rows + ids)", "sparse_all_gather_ms"),
        ("the per-worker batch on one process, both cores", "compute_all_cores_ms"),
        ("the per-worker batch on one process, one thread", "compute_one_thread_ms"),
    ]
    return lines + _table("part | ms", ([label, f"{report[key]:.2f}"] for label, key in parts))


def _plan(report: Dict) -> List[str]:
    lines = _para(f"Noise: options within {report['noise']:.0%} of the fastest count as agreeing.")
    table = []
    for r in report["results"]:
        where = r.get("point") or f"{r['rows']:,} rows, {r['ids_per_replica']:,} ids/replica, {r['distribution']}"
        times = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["times_s"].items())
        agrees = "yes" if r["agrees"] else "**no**"
        table.append(
            [r["family"], where, times, r["plan_chose"], r["fastest"], f"{r['chosen_vs_fastest']:.2f}", agrees]
        )
    lines += _table("family | point | options (ms) | plan chose | fastest | chosen / fastest | agrees", table)
    lines += _para("The planner's constants, fitted in this run and as the planner has them:")
    return lines + _table(
        "constant | fitted | the planner's",
        ([k, _cell(v, ",.3f"), _cell(report["constants"].get(k), ",")] for k, v in report["fitted"].items()),
    )


def _sharded(report: Dict) -> List[str]:
    lines = _para(
        f"Workload: {report['tables']} tables x {report['dim']} (across workers also other counts), "
        f"{report['ids_per_replica_and_table']} uniform ids "
        f"per table and replica, a dense head, Adagrad; medians of {report['rounds']} rounds of {report['steps']} "
        "steps."
    )
    table, plans = [], []
    for per in report["results"]:
        for r in per["results"]:
            table.append([
                replicas_label(per), str(r.get("tables", report["tables"])), f"{r['rows']:,}",
                f"{r['sharded_bytes_per_replica'] / 2**20:.1f}",
                f"{r['sharded_vs_even_share']:.3f}", f"{r['device_bytes_per_replica'] / 2**20:.1f}",
                _ms(r["sharded_step_s"]), _ms(r["device_step_s"]), f"{r['sharded_vs_device_step']:.2f}",
            ])  # fmt: skip
        plan = per["plan"]
        if plan is None:
            continue
        plans.append([str(per["replicas"]), f"{plan['memory_per_replica'] / 2**20:.1f}",
                      ", ".join(plan["placements"]), ", ".join(plan["built"]), plan["reason"]])  # fmt: skip
    lines += _table(
        "replicas | tables | rows per table | sharded MB per replica | / even share | device MB per replica | "
        "sharded ms | device ms | sharded / device",
        table,
    )
    across = [(per, r) for per in report["results"] for r in per["results"] if "sharded_gather_step_s" in r]
    if across:
        lines += _para(
            "Across workers, the sharded step over the transport the cost model chose (`sharded ms` above) and "
            "over the gather form (`tfs.exchange.workers`):"
        )
        lines += _table(
            "replicas | tables | rows per table | chosen transport | chosen ms | gather ms | chosen / gather",
            ([replicas_label(per), str(r["tables"]), f"{r['rows']:,}", r["transport"], _ms(r["sharded_step_s"]),
              _ms(r["sharded_gather_step_s"]), f"{r['chosen_vs_gather_step']:.2f}"] for per, r in across),
        )  # fmt: skip
    placement = report.get("placement")
    if placement:
        lines += _para(
            "`tfs.plan` with each point's ids (no memory budget), against the faster placement measured above "
            f"(within {placement['noise']:.0%} counts as agreeing):"
        )
        lines += _table(
            "replicas | tables | rows per table | distinct ids per replica | plan chose | fastest | chosen / fastest | "
            "agrees",
            ([replicas_label(p), str(p["tables"]), f"{p['rows']:,}", str(p["distinct_per_replica"]), p["plan_chose"],
              p["fastest"],
              f"{p['chosen_vs_fastest']:.2f}", "yes" if p["agrees"] else "**no**"] for p in placement["points"]),
        )  # fmt: skip
        lines += _para("The cost model's constants, fitted in this run and as the model has them:")
        lines += _table(
            "constant | fitted | the model's",
            ([k, _cell(v, ",.3f"), _cell(placement["constants"].get(k), ",")] for k, v in placement["fitted"].items()),
        )
    lines += _para("`tfs.plan` with `memory_per_replica` a third of one table and its slot:")
    lines += _table("replicas | memory_per_replica MB | planned | built | reason", plans)
    lines += _para(f"The application, `python -m tf_sharded train`, {report['app_steps']} steps:")
    return lines + _table(
        "strategy | sharded samples/s | device samples/s | sharded / device | sharded AUC | device AUC",
        ([f"`{app_label(a)}`", f"{a['sharded_samples_per_s']:,.0f}", f"{a['device_samples_per_s']:,.0f}",
          f"{a['sharded_vs_device']:.2f}", f"{a['sharded_auc']:.4f}", f"{a['device_auc']:.4f}"]
         for a in report["app"]),
    )  # fmt: skip


def _hybrid(report: Dict) -> List[str]:
    from tf_sharded.benchmarks.hybrid import LABELS

    lines = _para(
        f"The application (`python -m tf_sharded train`, DLRM, 26 tables), {report['steps']} steps, max vocabulary "
        f"{report['max_vocab']:,}; {report['workers']} workers, a process per task:"
    )
    rows = []
    for label, r in report["runs"].items():
        c = report["comparisons"].get(label)
        ratio = f"{c['hybrid_vs_samples_per_s']:.2f}" if c else ""
        difference = f"{c['auc_difference']:+.4f}" if c else ""
        rows.append(
            [LABELS[label], f"{r['samples_per_s']:,.0f}", f"{r['auc']:.4f}", ratio, difference,
             f"{r['cpu_s_per_1000_samples']:.2f}", f"{r['peak_resident_mib']:,.0f}",
             f"{r['held_mib']:,.1f} ({r['held_share_of_tables']:.1%})"]
        )  # fmt: skip
    lines += _table(
        "strategy | samples/s | held-out AUC | hybrid / this | hybrid AUC - this | CPU s / 1,000 samples | "
        "chief's peak MiB | chief's variables MiB (share of tables + slots)",
        rows,
    )
    goals = report["goals"]
    met = {goal: "met" if value else "**not met**" for goal, value in goals.items()}
    return lines + _para(
        f"Goals: hybrid at least 1.3x the multi-worker mirrored runs' samples/s: {met['speedup_vs_multi_worker']}; "
        f"AUC within 0.005 of them: {met['auc_within_synchronous']}; AUC at least the parameter servers': "
        f"{met['auc_at_least_parameter_server']}; a hybrid worker's variables at most 5% of the tables' bytes: "
        f"{met['worker_memory_share']}. CPU seconds count every process of a run, start-up, tracing and "
        "evaluation included; the tables' bytes are rows x width x 4 x (1 + the optimizer's slots per row)."
    )


def _metrics(report: Dict) -> List[str]:
    lines = _para(
        f"The application (`python -m tf_sharded train`, DLRM, 26 tables), {report['steps']:,} steps, max vocabulary "
        f"{report['max_vocab']:,}: with `TableMetrics` reporting every {report['every']} steps to a log directory, "
        "and with `--notable_metrics`, the runs alternating:"
    )
    lines += _table(
        "strategy | with (samples/s, each run) | without (each run) | with / without (medians)",
        ([f"`{name}`", ", ".join(f"{v:,.0f}" for v in r["with_samples_per_s"]),
          ", ".join(f"{v:,.0f}" for v in r["without_samples_per_s"]), f"{r['with_vs_without']:.3f}"]
         for name, r in report["results"].items()),
    )  # fmt: skip
    met = "met" if report["goals"]["at_most_3_percent_slower"] else "**not met**"
    return lines + _para(f"Goal: with / without at least 0.97 under every strategy: {met}.")


def _dynamic_churn(report: Dict) -> List[str]:
    r = report["results"][0]
    lines = _para(
        f"Workload: {report['inserted_keys']:,} keys, every one new ({report['steps']:,} timed steps of "
        f"{report['batch']} after one that traces), "
        f"into one table of dim {report['dim']} bounded by `CapacityEviction({report['capacity']:,})` (50 times its "
        "capacity), Adagrad; the baseline is the same table without eviction, on the same batches."
    )
    lines += _para("Median step (ms) per tenth of the run:")
    lines += _table(
        "table | " + " | ".join(str(i + 1) for i in range(len(r["churn_tenths_s"]))) + " | last / first",
        [
            ["capacity-bounded"] + [_ms(t) for t in r["churn_tenths_s"]] + [f"{r['churn_last_vs_first']:.2f}"],
            ["without eviction"] + [_ms(t) for t in r["baseline_tenths_s"]] + [f"{r['baseline_last_vs_first']:.2f}"],
            ["churned / baseline"] + [f"{x:.2f}" for x in r["churn_vs_baseline_tenths"]] + [""],
        ],
    )
    lines += _para("At the end (bytes held by the pools and the index):")
    return lines + _table(
        "table | live keys | pool rows | index buckets | bytes per live key",
        [
            [label, f"{t['live_keys']:,}", f"{t['pool_rows']:,}", f"{t['index_buckets']:,}"]
            + [f"{t['bytes_per_live_key']:.0f}"]
            for label, t in (("capacity-bounded", r["churn"]), ("without eviction", r["baseline"]))
        ],
    )


RENDERERS: Dict[str, Callable[[Dict], List[str]]] = {
    "ps": _ps,
    "exchange": _exchange,
    "memory": _memory,
    "e2e": _e2e,
    "fused": _fused,
    "dynamic": _dynamic,
    "dynamic_churn": _dynamic_churn,
    "recovery": _recovery,
    "quantize": _quantize,
    "mwprofile": _mwprofile,
    "plan": _plan,
    "sharded": _sharded,
    "hybrid": _hybrid,
    "metrics": _metrics,
}


# ------------------------------------------------------------------------------------------------ metadata


def command(report: Dict) -> str:
    """The command that writes this report: its `meta.command` if recorded, else rebuilt from the
    benchmark's name, cluster mode and `quick` (every such file is also written by `--mode both`)."""
    meta = report.get("meta") or {}
    if meta.get("command"):
        return str(meta["command"])
    name = report["benchmark"]
    words = ["python -m tf_sharded bench", name]
    if name not in SINGLE_RUN and report.get("mode"):
        words.append(f"--mode {report['mode']}")
    if report.get("quick"):
        words.append("--quick")
    return " ".join(words)


def _date(report: Dict) -> str:
    meta = report.get("meta") or {}
    if meta.get("date"):
        return str(meta["date"])
    # B8 stamps its kill events with the wall clock: the day of the run, though not its start.
    events = [e for r in report.get("results", []) for e in r.get("events", []) if isinstance(e, dict)]
    stamps = [e["first_step_time"] for e in events if isinstance(e.get("first_step_time"), (int, float))]
    if stamps:
        when = datetime.datetime.fromtimestamp(min(stamps), datetime.timezone.utc)
        return f"{NOT_RECORDED} (its first recovery event is stamped {when:%Y-%m-%d %H:%M} UTC)"
    return NOT_RECORDED


def _machine(report: Dict) -> str:
    meta = report.get("meta") or {}
    if meta.get("cores"):
        cores = f"{meta['cores']} cores"
    elif report.get("cores"):  # B1: the cores its process may run on
        cores = f"{report['cores']} cores usable by the benchmark"
    else:
        cores = f"cores {NOT_RECORDED}"
    memory = meta.get("memory_bytes")
    return "; ".join(
        [
            cores,
            f"{memory / 2**30:.1f} GiB memory" if memory else f"memory {NOT_RECORDED}",
            f"CPU {meta['cpu']}" if meta.get("cpu") else f"CPU model {NOT_RECORDED}",
        ]
    )


def _versions(report: Dict) -> str:
    meta = report.get("meta") or {}
    names = (("tensorflow", "TensorFlow"), ("keras", "Keras"), ("numpy", "NumPy"), ("python", "Python"))
    return ", ".join(f"{label} {meta.get(key) or NOT_RECORDED}" for key, label in names)


def _about(report: Dict) -> List[str]:
    meta = report.get("meta") or {}
    quick = " (small sizes: checks the JSON, not speed)" if report.get("quick") else ""
    lines = [
        f"- Command: `{command(report)}`{quick}",
        f"- Date: {_date(report)}",
        f"- Machine: {_machine(report)}",
        f"- Versions: {_versions(report)}",
        f"- Commit: {meta.get('commit') or NOT_RECORDED}",
    ]
    return lines + [""]


# ---------------------------------------------------------------------------------------------------- page


def _sections() -> List[Tuple[str, str, str]]:
    """(name, id, what it measures) of every benchmark of the suite, in the order of the first id number."""
    found = []
    for name, (_, description) in BENCHMARKS.items():
        ident, _, what = description.partition(": ")
        found.append((int(re.search(r"\d+", ident).group()), name, ident, what))
    return [(name, ident, what) for _, name, ident, what in sorted(found)]


def _posix(path: str) -> str:
    return path.replace(os.sep, "/")


def load(bench_dir: str) -> List[Tuple[str, object]]:
    """Every `*.json` under `bench_dir` as `(path, parsed JSON)`, sorted by directory, then name."""
    expected = "expected a directory of benchmark JSON files"
    if not os.path.exists(bench_dir):
        raise ReportError(f"--bench_dir {bench_dir}: {expected}, received a path that does not exist")
    if not os.path.isdir(bench_dir):
        raise ReportError(f"--bench_dir {bench_dir}: {expected}, received a file")
    paths = []
    for root, dirs, files in os.walk(bench_dir):
        dirs.sort()
        paths += [os.path.join(root, f) for f in files if f.endswith(".json")]
    paths.sort(key=lambda p: (os.path.dirname(os.path.relpath(p, bench_dir)), os.path.basename(p)))
    if not paths:
        raise ReportError(f"--bench_dir {bench_dir}: {expected} (*.json), received a directory with none")
    loaded = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                loaded.append((path, json.load(f)))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: expected a benchmark report in JSON, received invalid JSON ({e})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ReportError(f"{path}: expected a readable JSON file, received {type(e).__name__}: {e}") from None
    return loaded


def _block(name: str, path: str, title: str, report: Dict) -> List[str]:
    try:
        body = RENDERERS[name](report)
        about = _about(report)
    except KeyError as e:
        raise ReportError(f"{path}: expected a complete `{name}` report, received one without {e}") from None
    except (IndexError, TypeError, ValueError, AttributeError) as e:
        raise ReportError(
            f"{path}: expected a complete `{name}` report, received one its tables cannot read "
            f"({type(e).__name__}: {e})"
        ) from None
    mode = report.get("mode") if name not in SINGLE_RUN else None
    cluster = {"inprocess": " (in-process cluster)", "process": " (a process per task)"}.get(mode or "", "")
    return [f"#### {title}{cluster}", ""] + about + body


# The stack of a report that records no TensorFlow and lies in no directory named for one: the suite's reports
# record their versions since it was tested on two stacks; before, every run was on TF 2.16.2, the one
# TensorFlow setup.py pinned.
UNRECORDED_STACK = (2, 16)

_VERSION = re.compile(r"(\d+)\.(\d+)")
_STACK_DIRECTORY = re.compile(r"tf(\d+)\.(\d+)")
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2})(:\d{2})?")


class Run(NamedTuple):
    """The reports of one benchmark in one directory from one stack: one run (`--mode both` writes two files)."""

    name: str
    directory: str
    stack: Tuple[int, int]
    stack_from: str  # where `stack` was read: "recorded", "partly recorded", "directory" or "unrecorded"
    date: Optional[str]  # "YYYY-MM-DD HH:MM:SS" (UTC), the latest its reports record; None if none does
    rank: int  # the directory's place in the bench directory: its own files 0, then subdirectories by name
    reports: Tuple[Tuple[str, Dict], ...]


def stack_of(path: str, report: Dict) -> Tuple[Tuple[int, int], str]:
    """A report's stack, (major, minor) of TensorFlow, and where it was read: the version its `meta` records,
    else the `tfX.Y` its directory's name begins with, else `UNRECORDED_STACK`."""
    found = _VERSION.match(str((report.get("meta") or {}).get("tensorflow") or ""))
    if found:
        return (int(found.group(1)), int(found.group(2))), "recorded"
    found = _STACK_DIRECTORY.match(os.path.basename(os.path.dirname(path)))
    if found:
        return (int(found.group(1)), int(found.group(2))), "directory"
    return UNRECORDED_STACK, "unrecorded"


def _recorded_date(report: Dict) -> Optional[str]:
    """`meta.date` as "YYYY-MM-DD HH:MM:SS", which sorts as time does (the suite writes UTC); None if absent or
    not a date."""
    found = _DATE.match(str((report.get("meta") or {}).get("date") or ""))
    return f"{found.group(1)} {found.group(2)}{found.group(3) or ':00'}" if found else None


def runs(bench_dir: str, loaded: Sequence[Tuple[str, Dict]]) -> List[Run]:
    """The runs of the suite's reports in `loaded` (as `load` returns them), in load order."""
    directories = sorted({os.path.relpath(os.path.dirname(p), bench_dir) for p, _ in loaded}, key=_rank_key)
    grouped: Dict[Tuple[str, str, Tuple[int, int]], List[Tuple[str, Dict, str]]] = {}
    for path, report in loaded:
        stack, where = stack_of(path, report)
        grouped.setdefault((report["benchmark"], os.path.dirname(path), stack), []).append((path, report, where))
    found = []
    for (name, directory, stack), files in grouped.items():
        origins = {where for _, _, where in files}  # in one directory: "recorded" and at most one other
        stack_from = origins.pop() if len(origins) == 1 else "partly recorded"
        dates = [d for d in (_recorded_date(report) for _, report, _ in files) if d]
        rank = directories.index(os.path.relpath(directory, bench_dir))
        reports = tuple((path, report) for path, report, _ in files)
        found.append(Run(name, directory, stack, stack_from, max(dates, default=None), rank, reports))
    return found


def _rank_key(relative: str) -> Tuple[bool, str]:
    return (relative != os.curdir, _posix(relative))


def _age(run: Run) -> Tuple[bool, str, int]:
    """Sorts runs oldest first: a run recording a date is later than one recording none (the suite records the
    date of every run since it recorded any); dated runs by date; then by directory, the last sorted latest."""
    return (run.date is not None, run.date or "", run.rank)


def latest_and_older(found: Iterable[Run]) -> Tuple[Dict[Tuple[str, Tuple[int, int]], Run], Dict[str, List[Run]]]:
    """The latest run per (benchmark, stack), and per benchmark the others, newest stack first, newest first."""
    per_stack: Dict[Tuple[str, Tuple[int, int]], List[Run]] = {}
    for run in found:
        per_stack.setdefault((run.name, run.stack), []).append(run)
    latest, older = {}, {}
    for name, stack in sorted(per_stack, key=lambda key: (key[0], -key[1][0], -key[1][1])):
        candidates = sorted(per_stack[(name, stack)], key=_age, reverse=True)
        latest[(name, stack)] = candidates[0]
        older.setdefault(name, []).extend(candidates[1:])
    return latest, older


def stack_label(stack: Tuple[int, int]) -> str:
    return f"TF {stack[0]}.{stack[1]}"


def anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's) gives a heading: lower case, punctuation dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _shown_date(run: Run) -> str:
    return f"{run.date[:16]} UTC" if run.date else f"date {NOT_RECORDED}"


def _run_lines(run: Run, ident: str, rel: Callable[[str], str]) -> List[str]:
    """A run: its heading, date and stack as found, a block per report, the plot beside them."""
    how = {
        "recorded": "as its files record",
        "partly recorded": "as some of its files record",
        "directory": "from its directory's name (its files record no versions)",
        "unrecorded": (
            "by default: neither its files nor its directory's name say, as for every run from before the files "
            f"recorded versions, all of which were on {stack_label(UNRECORDED_STACK)}"
        ),
    }[run.stack_from]
    lines = [f"### {stack_label(run.stack)}: {rel(run.directory)}/", ""]
    lines += _para(f"Run: {_shown_date(run)}; stack {stack_label(run.stack)}, {how}.")
    for path, report in run.reports:
        lines += _block(run.name, path, rel(path), report)
    plot = os.path.join(run.directory, f"{run.name}.png")
    if os.path.isfile(plot):
        lines += _para(f"![{ident}, {rel(plot)}]({rel(plot)})")
    return lines


def render(bench_dir: str, out: str, history: str) -> Tuple[str, str, int]:
    """The results page to write at `out` (the latest run of each benchmark per stack) and the page of the older
    runs to write at `history`, each with its paths and links relative to itself, for the JSON under
    `bench_dir`; and how many JSON files they were written from."""
    loaded = load(bench_dir)
    out_dir, history_dir = (os.path.dirname(os.path.abspath(p)) for p in (out, history))

    def relative_to(page_dir: str) -> Callable[[str], str]:
        return lambda path: _posix(os.path.relpath(os.path.abspath(path), page_dir))

    rel, rel_history = relative_to(out_dir), relative_to(history_dir)
    reports: List[Tuple[str, Dict]] = []
    others: List[Tuple[str, str]] = []
    for path, report in loaded:
        name = report.get("benchmark") if isinstance(report, dict) else None
        if isinstance(name, str) and name in RENDERERS:
            reports.append((path, report))
        elif isinstance(report, dict):
            found = f"`benchmark` {name!r}" if name is not None else "no `benchmark`"
            others.append((path, f"{found}: not a benchmark of the suite"))
        else:
            others.append((path, f"a JSON {type(report).__name__}, not a report"))
    latest, older = latest_and_older(runs(bench_dir, reports))
    stacks = sorted({stack for _, stack in latest}, reverse=True)
    to_history, to_page = rel(history), rel_history(out)

    def generated(link: Callable[[str], str]) -> List[str]:
        root = link(bench_dir)
        return [
            f"_Generated by `python -m tf_sharded bench report` from the benchmark JSON in [{root}/]({root}/): do "
            "not edit by hand; rerun the command._",
            "",
        ]

    sections = [(name, ident, f"{ident}: {what}") for name, ident, what in _sections()]
    lines = generated(rel) + [
        "# Benchmark results",
        "",
        "One section per benchmark of `python -m tf_sharded bench`, and in it the latest run of the benchmark on "
        f"each stack, the newest stack first; the older runs are in [{to_history}]({to_history}), which the same "
        "command writes. A run is the JSON files of one benchmark in one directory from one stack (`--mode both` "
        "writes `NAME.json` and `NAME_process.json` in one run). A run's stack is the TensorFlow its files "
        "record, else the `tfX.Y` its directory's name begins with, else "
        f"{stack_label(UNRECORDED_STACK)} (the runs from before the files recorded versions were all on it). The "
        "latest run is the one whose files record the latest date; a run recording no date is older than one "
        "that does (the suite records it with every run), and among runs recording none the latest is in the "
        "directory sorting last, the bench directory's own files first.",
        "",
        "A run gives its files, each in a block: the command that writes such a file (as the file records it, "
        "else rebuilt from the benchmark's name and the `mode` and `quick` it records), what the file records of "
        f'its run ("{NOT_RECORDED}" where it does not) and its figures; then the plot `NAME.png` that the suite '
        "draws from every mode's report of one run, where it lies beside the files.",
        "",
        "## Runs shown",
        "",
    ]
    header = " | ".join(["benchmark"] + [stack_label(s) for s in stacks] + ["older runs"])
    index = []
    for name, ident, heading in sections:
        row = [f"[{ident}](#{anchor(heading)})"]
        for stack in stacks:
            run = latest.get((name, stack))
            row.append(f"{rel(run.directory)}/, {_shown_date(run)}" if run else "none")
        count = len(older.get(name, []))
        row.append(f"[{count}]({to_history}#{anchor(heading)})" if count else "none")
        index.append(row)
    lines += _table(header, index)
    lines += [READING, ""]
    for name, ident, heading in sections:
        lines += [f"## {heading}", ""]
        shown = [latest[(name, s)] for s in stacks if (name, s) in latest]
        if not shown:
            lines += _para(f"No report in {rel(bench_dir)}/: `python -m tf_sharded bench {name}` writes one.")
            continue
        if older.get(name):
            count = len(older[name])
            runs_word = "run" if count == 1 else "runs"
            lines += _para(f"Older runs: {count} {runs_word} in [{to_history}]({to_history}#{anchor(heading)}).")
        for run in shown:
            lines += _run_lines(run, ident, rel)
    if others:
        lines += ["## Files not shown", ""]
        lines += [f"- `{rel(path)}`: {why}" for path, why in others] + [""]

    past = generated(rel_history) + [
        "# Benchmark results: older runs",
        "",
        f"The runs that [{to_page}]({to_page}) does not show: of each benchmark on each stack, every run but the "
        "latest, the newest stack first, the newest run first, each as that page gives a run. That page says how "
        "a run's stack and the latest run are found, and how to read the ratios.",
        "",
    ]
    if not any(older.values()):
        past += _para(f"No older run: [{to_page}]({to_page}) shows every run.")
    for name, ident, heading in sections:
        if older.get(name):
            past += [f"## {heading}", ""]
            past += _para(f"The latest runs: [{to_page}]({to_page}#{anchor(heading)}).")
            for run in older[name]:
                past += _run_lines(run, ident, rel_history)

    def text(page: List[str]) -> str:
        return "\n".join(page).rstrip("\n") + "\n"

    return text(lines), text(past), len(loaded)


def history_path(out: str) -> str:
    """The page of older runs beside the page at `out`: `benchmarks.md` gives `benchmarks-history.md`."""
    stem, ext = os.path.splitext(out)
    return f"{stem}-history{ext or '.md'}"


def write(bench_dir: str, out: str, history: Optional[str] = None) -> int:
    """Writes the results page for `bench_dir` to `out` and the page of older runs to `history` (default
    `history_path(out)`); returns how many JSON files they were written from."""
    history = history or history_path(out)
    if os.path.abspath(history) == os.path.abspath(out):
        raise ReportError(f"--history {history}: expected a file other than --out's, received the same path")
    page, past, count = render(bench_dir, out, history)
    for flag, path, text in (("--out", out, page), ("--history", history, past)):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
        except OSError as e:
            received = f"{type(e).__name__}: {e.strerror}"
            raise ReportError(f"{flag} {path}: expected a writable file path, received {received}") from None
    return count


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tf_sharded bench report", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--bench_dir", default="docs/bench", metavar="DIR", help="the benchmark JSON, read recursively (%(default)s)"
    )
    parser.add_argument(
        "--out", default="docs/benchmarks.md", metavar="FILE", help="the page of the latest runs (%(default)s)"
    )
    parser.add_argument(
        "--history", metavar="FILE", help="the page of the older runs (default: beside --out, NAME-history.md)"
    )
    args = parser.parse_args(argv)
    history = args.history or history_path(args.out)
    try:
        count = write(args.bench_dir, args.out, history)
    except ReportError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} and {history} from {count} JSON file(s) under {args.bench_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
