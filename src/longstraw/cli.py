"""The `longstraw` command line: `longstraw train ...`, `longstraw plan ...`, `longstraw check ...`,
`longstraw --version`. (The benchmarks are a separate package: `python -m benchmarks NAME`.)

Each command is an argparse subparser, dispatched by name in `main`. Commands import their heavy modules only when they
run: building the parser imports no torch or transformers (`--version` and `--help` answer in well under a second;
tests/test_cli.py checks that torch stays unimported). Before anything imports torch, `main` sets
OMP_WAIT_POLICY=PASSIVE unless the user set it (`passive_openmp_wait`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, MutableMapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from longstraw import __version__
from longstraw.choices import did_you_mean

if TYPE_CHECKING:
    from longstraw.train.config import TrainConfig


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, wrapping lines at spaces only: a name such as tiny-llama stays on one line."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """argparse with the error first: one line saying what to change (with the closest names for a mistyped choice),
    then one short usage line, instead of the whole usage text above it. Every subcommand's parser is one too
    (`add_subparsers` makes its parsers of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if sys.version_info >= (3, 14):  # argparse's own suggestions ("maybe you meant"): ours alone, on every Python
            kwargs.setdefault("suggest_on_error", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._words = list(sys.argv[1:] if args is None else args)  # for `error`'s hints on mistyped options
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):  # perhaps one of them was mistyped
            message += "".join(self._option_hints(getattr(self, "_words", [])))
        self.exit(2, f"{self.prog}: error: {message}\n{self.short_usage()}\n")

    def _option_hints(self, words: list[str]) -> list[str]:
        """' (did you mean --x?)' for each word that looks like an option this parser does not have."""
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        names = [word.split("=", 1)[0] for word in words]
        hints = [did_you_mean(name, options, what=name, n=2) for name in names
                 if name.startswith("--") and name not in options]
        return [h for h in hints if h]

    def short_usage(self) -> str:
        """argparse's usage when it fits one line; else the command, its positionals, and where the options are."""
        usage = self.format_usage().strip()
        words = ["[options]"]
        for action in self._actions:
            if action.option_strings:
                continue
            name = str(action.metavar or action.dest)
            words.append(f"[{name}]" if action.nargs in ("?", "*") else name)
            if isinstance(action, argparse._SubParsersAction):  # the commands by name, on the same line
                usage = " ".join(usage.split()) + f"  ({name}: {', '.join(action.choices)})"
        if "\n" not in usage:
            return usage
        return f"usage: {self.prog} {' '.join(words)}  ({self.prog} --help lists the options)"

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check (a value outside `choices`), with the closest choices named after its message
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as err:
            hint = did_you_mean(value, action.choices or ())
            if not hint:
                raise
            raise argparse.ArgumentError(action, err.message + hint) from None

    def unknown_options(self, extra: list[str]) -> NoReturn:
        """Refuse arguments no option of this parser takes, naming the closest option for each mistyped one."""
        self.exit(2, f"{self.prog}: error: unrecognized arguments: {' '.join(extra)}"
                     f"{''.join(self._option_hints(extra))}\n{self.short_usage()}\n")


def build_parser() -> Parser:
    parser = Parser(prog="longstraw",
                    description="GRPO on very long shared prompts: training, the memory planner, admission checks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from longstraw import planner
    from longstraw.admission import check
    from longstraw.train import config

    parsers = {}
    for name, module, help_text, description in (
        ("check", check, "admission check: a tiny float64 copy of a model's own config against transformers",
         "Build a tiny float64 copy of MODEL's config (its model type, multipliers, flags and layer-kind pattern; "
         "sizes shrunk) and measure LongStraw's replayed and sampled log-probs and its exact gradient against "
         "transformers' own forward. Prints the numbers and the verdict; exit status 1 when refused. --all checks "
         "every causal-LM type of this transformers."),
        ("plan", planner, "memory planner: per-GPU memory of every plan, whether it fits, the largest prompt",
         "Predict per-GPU memory by component for standard_batched, standard, detach and exact."),
        ("train", config, "GRPO training on a long-context task",
         "Train with GRPO: options from an optional TOML file, overridden by flags."),
    ):
        parsers[name] = commands.add_parser(name, help=help_text, description=description)
        module.add_arguments(parsers[name])
        # check and plan run here; train through `main`. `fail`: the command's own parser reports its errors
        parsers[name].set_defaults(run=getattr(module, "run_from_args", None), fail=parsers[name].error)
    train_parser = parsers["train"]
    train_parser.add_argument(
        "--nproc", type=int, default=1,
        help="processes (ranks) on this machine, one per GPU with --device cuda; launched through torchrun, "
             "the model sharded with FSDP2 and each step's prompts split across ranks (default: 1)")
    train_parser.add_argument(
        "--debug", action="store_true",
        help="on an expected error (bad input, a failing reward function, Ctrl-C) also print the traceback")
    return parser


def passive_openmp_wait(environ: MutableMapping[str, str] | None = None,
                        modules: Mapping[str, object] | None = None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` (default os.environ) unless it is set already or torch is in
    `modules` (default sys.modules, since libgomp reads it once, when torch loads); return whether it was set.

    Why: GNU OpenMP (torch's CPU thread pool) spin-waits at the end of each parallel region; on a shared host a
    descheduled thread keeps the others spinning for a scheduler slice, and replay runs many small regions per step.
    PASSIVE lets them sleep: slower by 3-15% on an idle host, much faster on a busy one (docs/benchmarks.md, "Busy
    hosts"). Bench workers inherit the environment, so LongStraw and its peers run under the same policy."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules or "OMP_WAIT_POLICY" in environ:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def main(argv: list[str] | None = None) -> int:
    passive_openmp_wait()  # first: before any command imports torch
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported through the subcommand's parser: its usage, its options' names
        fail = getattr(args, "fail", None)
        getattr(fail, "__self__", parser).unknown_options(extra)
    if args.command in ("check", "plan"):
        return int(args.run(args))
    if args.command == "train":
        from longstraw.train import config, data, trainer

        try:
            cfg = config.from_args(args)
            data.check_data(cfg)  # a jsonl file's lines and held-out split, before the run directory is created
            data.check_model(cfg)  # the model's name and declared positions, before the run directory too
        except (ValueError, FileNotFoundError) as err:
            args.fail(str(err))
        if args.nproc != 1:
            return _launch_train(args, cfg, sys.argv[1:] if argv is None else argv)
        return _train(trainer, cfg, args.debug)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _train(trainer: ModuleType, cfg: TrainConfig, debug: bool) -> int:
    """Run training; expected failures end with one line (and the trainer's line saying where the last completed
    step is saved) and a non-zero status, without a traceback unless --debug. Anything else is a bug: traceback."""
    import signal
    import traceback

    try:
        trainer.train(cfg)
    except (KeyboardInterrupt, ValueError, FileNotFoundError, FloatingPointError) as err:
        if debug:
            traceback.print_exc()
        if not isinstance(err, KeyboardInterrupt):
            print(f"longstraw train: error: {err}", file=sys.stderr)
            return 1
        # Ctrl-C, or SIGINT/SIGTERM turned into TrainingInterrupted
        signum = getattr(err, "signum", signal.SIGINT)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # a rank of --nproc: its launcher prints this line
            print(f"longstraw train: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + int(signum)
    return 0


def _launch_train(args: argparse.Namespace, cfg: TrainConfig, argv: list[str]) -> int:
    """`train --nproc N`: check N, then run the same command as N torchrun workers (without --nproc)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from longstraw.distributed import launch
    from longstraw.train import preflight
    from longstraw.train.rundir import check_not_in_use

    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        args.fail("this process was already started by torchrun: drop --nproc (torchrun's --nproc-per-node sets it)")
    try:
        launch.check_nproc(args.nproc, cfg.model.device, cfg.rollout.prompts_per_step, cfg.parallelism.cp,
                           cfg.parallelism.tp)
        preflight.distributed_rules(cfg, args.nproc)
    except ValueError as err:
        args.fail(str(err))
    try:
        check_not_in_use(cfg.run.run_dir)  # another process writing it: refused here, before any rank starts
        # what each rank would refuse once it has loaded the model: here once, without the weights, before any rank
        # starts and before the run directory exists
        preflight.check_before_ranks(cfg, args.nproc)
    except (ValueError, FileNotFoundError) as err:
        print(f"longstraw train: error: {err}", file=sys.stderr)
        return 1
    try:
        return launch.launch_train(launch.strip_nproc(argv[argv.index("train") + 1 :]), args.nproc)
    except ChildFailedError as err:
        print(f"longstraw train: error: a rank failed; torchrun reports:\n{err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
