"""The `longstraw` command line: `longstraw bench memory ...`, `longstraw train ...`, `longstraw --version`.

Each command is an explicit argparse subparser, dispatched by name in `main`; a new command (`bench prompt`,
`train`, `plan`) is one more `add_parser` call and one more branch. Commands import their heavy modules only
when they run.
"""

from __future__ import annotations

import argparse
import sys

from longstraw import __version__


def build_parser() -> argparse.ArgumentParser:
    from longstraw.bench import memory

    parser = argparse.ArgumentParser(
        prog="longstraw", description="GRPO on very long shared prompts: benchmarks and tools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    bench = commands.add_parser("bench", help="benchmarks (DESIGN §5)", description="Run a benchmark.")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    memory_parser = benches.add_parser(
        "memory", help="peak memory and step time of every plan across group sizes (Bench B1)",
        description="Bench B1: each (plan, G) in a fresh process; peak memory, step time, plan ratios.",
    )
    memory.add_arguments(memory_parser)
    # Option checks that argparse cannot express report through the subcommand's own usage line.
    memory_parser.set_defaults(fail=memory_parser.error)

    from longstraw import config

    train_parser = commands.add_parser(
        "train", help="GRPO training on a long-context task",
        description="Train with GRPO: options from an optional TOML file, overridden by flags.",
    )
    config.add_arguments(train_parser)
    train_parser.set_defaults(fail=train_parser.error)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.bench == "memory":
        from longstraw.bench import memory

        return memory.run_from_args(args)
    if args.command == "train":
        from longstraw import config, trainer

        try:
            cfg = config.from_args(args)
        except (ValueError, FileNotFoundError) as err:
            args.fail(str(err))
        try:
            trainer.train(cfg)
        except (ValueError, FileNotFoundError, FloatingPointError) as err:
            print(f"longstraw train: error: {err}", file=sys.stderr)
            return 1
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
