"""Command line: `python -m tf_sharded COMMAND` (also the `tf-sharded` script)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m tf_sharded COMMAND

commands:
  train [--model dlrm|deepfm|mlp] [--data synthetic|PATH] [--schema FILE] [--format auto|tsv|csv|tfrecord|parquet]
        [--strategy parameter_server|mirrored|multi_worker|hybrid|default] [--num_workers N] [--num_ps N]
        [--steps N] [--batch_size N] [--optimizer sgd|adagrad|adam|ftrl] [--learning_rate X]
        [--checkpoint_dir DIR] [--eval_steps N] [--max_vocab N] [--strict] ...
          train a model on synthetic data or your files (python -m tf_sharded train --helpfull for every flag)
  schema infer --data PATH [--label COLUMN] [--out FILE]
          a starting feature schema (JSON) from a file's first rows
  data synthesize [--dataset criteo|ratings] --format FORMAT --rows N --out DIR [--max_vocab N] [--seed N]
          write synthetic data as files: Criteo-shaped (tsv, parquet) or movie
          ratings (csv, tfrecord, parquet; string ids, multi-hot genres)
  inspect CHECKPOINT
          tables, shapes, dtypes, sizes and the layout a checkpoint was saved from
  demo    train a sharded table on a local parameter-server cluster, save it,
          and restore it into another layout
  bench [ps|exchange|fused|memory|e2e ...] [--quick] [--out DIR] [--mode inprocess|process|both]
          the benchmark suite (default: all): tables, ratios, JSON and PNG in bench_results/
  bench report [--bench_dir DIR] [--out FILE] [--history FILE]
          the results pages from the benchmarks' JSON (docs/bench/): the latest run of each
          benchmark per stack (docs/benchmarks.md), the older runs (docs/benchmarks-history.md)

--verbose (with any command) shows TensorFlow's own C++ log, which is hidden otherwise
(as it is whenever TF_CPP_MIN_LOG_LEVEL is set: then that level applies).
"""


def main(argv=None) -> int:
    from tf_sharded._console import without_switch

    # `--verbose` alone was read when the package loaded TensorFlow (`tf_sharded._console`).
    argv = without_switch(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "train":
        from tf_sharded.app import cli

        return cli.main(argv[1:])
    if argv[0] == "data" and len(argv) > 1 and argv[1] == "synthesize":
        return _synthesize(argv[2:])
    if argv[0] == "schema" and len(argv) > 1 and argv[1] == "infer":
        return _infer(argv[2:])
    if argv[0] == "inspect":
        from tf_sharded.app import cli

        if len(argv) != 2:
            print("usage: python -m tf_sharded inspect CHECKPOINT", file=sys.stderr)
            return 2
        try:
            return cli.inspect_checkpoint(argv[1])
        except (FileNotFoundError, ValueError) as e:
            print(f"error: inspect: {e}", file=sys.stderr)
            return 1
    if argv[0] == "demo":
        from tf_sharded.app import demo

        demo.main()
        return 0
    if argv[0] == "bench":
        from tf_sharded.benchmarks import suite

        return suite.main(argv[1:])
    print(f"unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _synthesize(argv) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tf_sharded data synthesize")
    parser.add_argument("--dataset", default="criteo", choices=["criteo", "ratings"])
    parser.add_argument("--format", required=True, choices=["tsv", "csv", "tfrecord", "parquet"])
    parser.add_argument("--rows", required=True, type=int)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max_vocab", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be a positive int, received {args.rows}")
    from tf_sharded.app import data

    allowed = ("tsv", "parquet") if args.dataset == "criteo" else data.RATINGS_FORMATS
    if args.format not in allowed:
        parser.error(f"--format {args.format}: --dataset {args.dataset} is written as one of {', '.join(allowed)}")
    if args.dataset == "ratings":
        files = data.synthesize_ratings(args.format, args.rows, args.out, args.seed)
    else:
        files = data.synthesize(args.format, args.rows, args.out, args.max_vocab, args.seed)
    print(f"wrote {args.rows} rows to {len(files)} {args.format} file(s) in {args.out}")
    return 0


def _infer(argv) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tf_sharded schema infer")
    parser.add_argument("--data", required=True, help="a file or directory (its first file is read)")
    parser.add_argument("--label", default=None, help="the label column (default: the first)")
    parser.add_argument("--format", default=None, choices=["tsv", "csv", "tfrecord", "parquet"])
    parser.add_argument("--out", default=None, help="write the schema here (default: print it)")
    args = parser.parse_args(argv)
    from tf_sharded.app import readers, scan, schema

    try:
        columns, lists = scan.sample_columns(args.data, fmt=args.format)
        inferred = schema.infer_from_columns(columns, label=args.label, list_columns=lists)
    except (readers.InputError, schema.SchemaError, FileNotFoundError) as e:
        print(f"error: --data {args.data}: {e}", file=sys.stderr)
        return 1
    text = json.dumps(inferred.to_json(), indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(
            f"wrote a schema for {len(inferred.features)} features to {args.out}; check it, then train with "
            f"--schema {args.out}"
        )
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
