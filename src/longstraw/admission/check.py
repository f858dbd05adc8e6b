"""`longstraw check`: the admission check of one model's config, or of every causal-LM type of this transformers.

Building the parser imports neither torch nor transformers (`longstraw --help` stays fast); running the check does.

`longstraw check MODEL` prints `verify`'s numbers and the verdict; `longstraw check --all` checks every type of
transformers' causal-LM mapping and writes the table docs/architectures.md includes (which describes both)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from longstraw.admission.released import NOT_DECODER_ONLY_TEXT, causal_lm_types, released_source, sweep_config


def with_planner(verdict: Any, config: Any) -> Any:
    """`verdict` with the planner's formula for its prompt state (`planner_bytes`; None for a family it lacks)."""
    from longstraw.admission.tiny import tiny_config
    from longstraw.planner.families import spec_from_config
    from longstraw.planner.formulas import state_bytes

    try:
        tiny, _ = tiny_config(config)
        spec = spec_from_config(tiny, verdict.model_type)
        formula = state_bytes(spec, 40, 8, 16, exact=True)[0]
    except Exception:  # the planner has no formula for this family's layers
        formula = None
    return dataclasses.replace(verdict, planner_bytes=formula)


def _row(model_type: str) -> dict[str, Any]:
    from longstraw.admission import verify
    from longstraw.models.architecture import REFUSED_MODEL_TYPES

    started = time.perf_counter()
    row: dict[str, Any]
    if model_type in REFUSED_MODEL_TYPES:  # a known missing mechanism: refused without a check
        row = {"model_type": model_type, "kind": "refused", "reason": f"refused: {REFUSED_MODEL_TYPES[model_type]}"}
    else:
        try:
            config = sweep_config(model_type)
            verdict = with_planner(verify.verify(config), config)
            row = dict(dataclasses.asdict(verdict), model_type=model_type, config_model_type=verdict.model_type)
        except Exception as err:  # the config class itself cannot be built from its defaults
            row = {"model_type": model_type, "kind": "refused",
                   "reason": f"its default config cannot be built: {type(err).__name__}: {str(err)[:200]}"}
    row["decoder_only_text"] = model_type not in NOT_DECODER_ONLY_TEXT
    row["values"] = released_source(model_type)
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def _short(row: dict[str, Any]) -> str:
    """The table's 'why' cell: the measured difference, the crash, or the first layer that differs."""
    if row["kind"] != "refused":
        worst = max((row.get(k) or 0.0) for k in ("logprob_error", "gradient_error", "sampled_error"))
        return f"max error {worst:.1e} (tolerance {row.get('tolerance', 0):g})"
    if str(row.get("reason", "")).startswith(("the check crashed", "refused:", "no tiny copy", "its default")):
        return str(row["reason"]).replace("|", "/")[:240]
    errors = (("log-probs", "logprob_error"), ("gradient", "gradient_error"), ("sampled", "sampled_error"))
    parts = [f"{name} off by {row[key]:.2g}" for name, key in errors
             if row.get(key) is not None and row[key] > row.get("tolerance", 0)]
    if row.get("first_difference"):
        parts.append(f"first differs at {row['first_difference']}")
    if row.get("reason") and not parts:
        parts.append(row["reason"])
    return "; ".join(parts).replace("|", "/")[:240]


def markdown(rows: list[dict[str, Any]], source: str) -> str:
    """The table of every type: verdict and why, decoder-only text types first."""
    import transformers

    decoders = [r for r in rows if r["decoder_only_text"]]
    admitted = [r for r in decoders if r["kind"] != "refused"]
    lines = [
        f"Written by `longstraw check --all` ({source}); transformers {transformers.__version__}. "
        f"{len(admitted)} of {len(decoders)} decoder-only text types admitted "
        f"({sum(r['kind'] == 'exact' for r in admitted)} exact in float64, "
        f"{sum(r['kind'] != 'exact' for r in admitted)} exact within float32 kernels).",
        "",
        "The config column says whose values the check's config holds: a released checkpoint's (admission/"
        "released_configs.json), the class defaults checked equal to a released config, or the class defaults.",
        "",
        "| model type | verdict | measured / why | config |",
        "|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (not r["decoder_only_text"], r["model_type"])):
        kind = r["kind"] if r["decoder_only_text"] else f"{r['kind']} (not a decoder-only text model)"
        values = r.get("values") or released_source(r["model_type"])
        lines.append(f"| `{r['model_type']}` | {kind} | {_short(r)} | {values} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from longstraw.choices import PRESET_NAMES

    parser.add_argument("model", nargs="?", help="a hub id, a directory or config.json, a .gguf file or a preset "
                                                 f"({', '.join(PRESET_NAMES)})")
    parser.add_argument("--all", action="store_true",
                        help="check every causal-LM type of this transformers (its class defaults, with a released "
                             "checkpoint's multipliers where known)")
    parser.add_argument("--only", default=None, help="with --all: comma-separated model types to check")
    parser.add_argument("--out", default=None, help="write the verdicts as JSON to this file")
    parser.add_argument("--markdown", default=None, help="with --all: write the table of verdicts to this file")
    parser.add_argument("--no-cache", action="store_true",
                        help="measure MODEL again even where its verdict is cached (the cache is then rewritten)")


def writable_file(option: str, path: str) -> str | None:
    """Why `path` cannot be written (a missing or read-only folder, a directory of that name), or None."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        return f"{option} {path}: is a directory; give a file path"
    if not folder.is_dir():
        return f"{option} {path}: folder {folder} does not exist; create it or give another path"
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{option} {path}: not writable; give a path you can write"
    return None


def _check_options(args: argparse.Namespace) -> None:
    """The options' agreement and the output files' folders, before any check runs."""
    if args.all == (args.model is not None):
        args.fail("give one MODEL or --all")
    if not args.all:
        for option, value in (("--markdown", args.markdown), ("--only", args.only)):
            if value is not None:
                args.fail(f"{option} goes with --all (the table of every type); for one MODEL use --out")
    elif args.no_cache:
        args.fail("--no-cache goes with one MODEL (--all measures every type without the cache)")
    for option, value in (("--out", args.out), ("--markdown", args.markdown)):
        why = writable_file(option, value) if value else None
        if why:
            args.fail(why)


def run_from_args(args: argparse.Namespace) -> int:
    _check_options(args)
    if args.all:
        return _run_all(args)
    from longstraw.admission import verify
    from longstraw.planner.spec import load_config

    try:
        config = load_config(args.model)
    except ValueError as err:
        args.fail(str(err))
    verdict = with_planner(verify.verdict_for(config, refresh=args.no_cache), config)
    print(verdict.summary())
    print(cache_line(verdict))
    if args.out:
        saved = {k: v for k, v in dataclasses.asdict(verdict).items() if k not in ("cache_file", "from_cache")}
        Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
    return 0 if verdict.admitted else 1


def cache_line(verdict: Any) -> str:
    """Whether the verdict was read from the cache or measured now, and its file."""
    if verdict.from_cache:
        return (f"  verdict read from the cache: {verdict.cache_file} (measured {verdict.seconds:.1f} s then; "
                "--no-cache measures again)")
    if verdict.cache_file:
        return f"  verdict measured now; cached in {verdict.cache_file}"
    return "  verdict measured now; not cached (the cache folder cannot be written; LONGSTRAW_CACHE moves it)"


def _run_all(args: argparse.Namespace) -> int:
    import transformers

    types = causal_lm_types()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(types)
        if unknown:
            args.fail(f"not causal-LM types of transformers {transformers.__version__}: {', '.join(sorted(unknown))}")
        types = [t for t in types if t in wanted]
    rows = []
    for i, model_type in enumerate(types):
        row = _row(model_type)
        rows.append(row)
        print(f"[{i + 1}/{len(types)}] {model_type:<28} {row['kind']:<30} {_short(row)[:90]}", flush=True)
    decoders = [r for r in rows if r["decoder_only_text"]]
    print(f"{sum(r['kind'] != 'refused' for r in decoders)} of {len(decoders)} decoder-only text types admitted",
          file=sys.stderr)
    if args.out:
        meta = {"transformers": transformers.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args.out or "no results file"))
    return 0
