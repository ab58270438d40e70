"""Command line: `python -m tf_sharded demo` (also the `tf-sharded` script)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m tf_sharded COMMAND

commands:
  demo    train a sharded table on a local parameter-server cluster, save it,
          and restore it into another layout
  bench exchange [--quick] [--out DIR]
          mirrored gradient exchange sweep (allgather / dense / auto vs TF)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "demo":
        from tf_sharded import demo

        demo.main()
        return 0
    if argv[0] == "bench" and len(argv) > 1 and argv[1] == "exchange":
        from tf_sharded.benchmarks import exchange

        return exchange.main(argv[2:])
    print(f"unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
