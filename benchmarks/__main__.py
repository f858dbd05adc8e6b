"""`python -m benchmarks NAME [options]`: run one benchmark of `benchmarks.registry` (`--help` lists them).

SIGTERM (what `timeout` and schedulers send) is raised like Ctrl-C, so every process a benchmark started is ended on
the way out (its `finally` blocks run; `subprocess.run` kills its child); either ends with one line and status
128 + signal, no traceback.
"""

from __future__ import annotations

import json
import signal
import sys

from benchmarks.registry import benchmarks, verdict_lines
from longstraw.cli import Parser, passive_openmp_wait


def build_parser() -> Parser:
    """The parser: one subparser per registered benchmark; each subparser's `fail` reports through its own usage."""
    parser = Parser(prog="python -m benchmarks", description="LongStraw's benchmarks (docs/benchmarks.md).")
    names = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for bench in benchmarks().values():
        sub = names.add_parser(bench.name, help=bench.help, description=bench.description)
        bench.add_arguments(sub)
        if bench.table is not None:
            sub.add_argument("--table-of", metavar="FILE", help="print the table of this results file and exit")
        if bench.checks is not None:
            sub.add_argument("--checks-of", metavar="FILE",
                             help="print the verdict of each of this benchmark's checks on this results file and exit "
                                  "(status 1 when one fails)")
        # Option checks that argparse cannot express report through the benchmark's own usage line.
        sub.set_defaults(fail=sub.error, run=bench.run, table=bench.table, checks=bench.checks)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM raised as an exception, like Ctrl-C's KeyboardInterrupt; `signum` gives the exit status."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"signal {signum}")


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) and run the benchmark it names; returns the exit status."""
    passive_openmp_wait()  # first: before any benchmark imports torch
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported through the benchmark's parser: its usage, its options' names
        args.fail.__self__.unknown_options(extra)
    if getattr(args, "table_of", None):
        with open(args.table_of) as f:
            print(args.table(json.load(f)))
        return 0
    if getattr(args, "checks_of", None):
        with open(args.checks_of) as f:
            lines, passed = verdict_lines(args.checks(json.load(f)))
        print("\n".join(lines))
        return 0 if passed else 1
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.run(args))
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"python -m benchmarks {args.bench}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + int(signum)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
