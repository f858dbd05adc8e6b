"""`python -m benchmarks peers`: the smoke run end to end, failures recorded rather than raised, the table's
strongest-peer ratios, and the Prefix Grouper path's gradient against LongStraw's on the same group."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import child_pids, running

from benchmarks import peers
from benchmarks.__main__ import main
from benchmarks.common import TIMING_THRESHOLD, combine_runs
from benchmarks.launch import BUSY_LOOP, busy_neighbours, worker_env
from benchmarks.peers import (
    SHAPES,
    Configuration,
    configurations,
    format_table,
    run_peer,
    run_peers_bench,
    summarize,
)

IMPORT_PATH = os.pathsep.join(str(Path(__file__).resolve().parents[2] / d) for d in ("src", "."))
HAVE_PREFIX_GROUPER = importlib.util.find_spec("prefix_grouper") is not None


@pytest.fixture
def workers_see_this_checkout(monkeypatch):
    """Workers are fresh interpreters: make them import this checkout's package (a worktree's, too)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (IMPORT_PATH, os.environ.get("PYTHONPATH")) if p))


@pytest.mark.slow
def test_smoke_run_writes_every_configuration_with_a_status(tmp_path, capsys, workers_see_this_checkout):
    out = tmp_path / "peers.json"
    assert main(["peers", "--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    shape = SHAPES["smoke"]
    assert doc["bench"] == "peers" and doc["smoke"] and doc["shape"]["model"] == shape.model
    assert doc["machine"]["cpu_count"]
    results = {r["id"]: r for r in doc["results"]}
    assert list(results) == [c.id for c in configurations(shape.group_size)]
    for r in results.values():
        if r["peer"] == "prefix_grouper":
            assert r["status"] == ("ok" if HAVE_PREFIX_GROUPER else "not installed"), r
        else:
            assert r["status"] == "ok", r
    ok = [r for r in results.values() if r["status"] == "ok"]
    for r in ok:
        assert r["peak_bytes"] >= 0 and r["time_s"] > 0 and r["hwm_reset"] is not None
    for r in results.values():
        if r["peer"] == "trl":  # TRL's own train loop ran the micro-steps, with checkpointing as configured
            assert r["micro_steps"] == r["accumulation"] == shape.group_size // r["batch"]
            assert r["gradient_checkpointing"] == r["checkpoint"]
            # TRL's head scored only the completions (as on CUDA), not the prompt positions as on CPU
            assert r["trl_compact_head"] and r["trl_head_rows"] == r["batch"] * shape.response_tokens, r
        if r["peer"] != "longstraw" and r["status"] == "ok":
            assert r["peer_version"], r
    # On-policy, every configuration's grpo loss is -mean(advantages) of the same group.
    losses = [r["loss"] for r in ok]
    assert max(losses) - min(losses) < 1e-5, losses
    printed = capsys.readouterr().out
    assert "TRL, 1 per batch x 4 accumulation + checkpointing: ok" in printed and str(out) in printed
    assert not os.path.exists(str(out) + ".tmp")
    # No timing run in a smoke run, and the document says so; no neighbours; the OpenMP policy recorded and printed.
    assert doc["neighbours"] == 0 and doc["timing_run"].startswith("skipped (smoke)")
    assert all("timing_run" not in r and "time_fixed_threshold_s" not in r for r in results.values())
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    assert doc["machine"]["omp_wait_policy"] == policy
    assert f"busy-loop neighbours: 0; OMP_WAIT_POLICY: {policy}" in printed


def test_a_failing_peer_is_recorded_not_raised(tmp_path, workers_see_this_checkout):
    shape = SHAPES["smoke"]
    bad = Configuration("trl-b3", "TRL, 3 per batch", "trl", batch=3)  # 3 does not divide G = 4: the worker fails
    doc = run_peers_bench(shape, str(tmp_path / "peers.json"), timeout_s=300, smoke=True, rows=[bad])
    (entry,) = doc["results"]
    assert entry["status"] == "failed" and "does not divide" in entry["error"], entry
    assert "Traceback" in entry["stderr_tail"]
    trl = next(c for c in configurations(shape.group_size) if c.peer == "trl")
    late = run_peer(shape, trl, timeout_s=0.01, smoke=True)
    assert late["status"] == "failed" and "timed out" in late["error"]


def test_prefix_grouper_not_installed_is_a_status(monkeypatch):
    from benchmarks import peers_worker

    monkeypatch.setitem(sys.modules, "prefix_grouper", None)  # import prefix_grouper now raises ImportError
    monkeypatch.setitem(sys.modules, "prefix_grouper.utils.register_transformers", None)
    shape = SHAPES["smoke"]
    config = {"peer": "prefix_grouper", "model": shape.model, "dtype": "float32", "device": "cpu",
              "prompt_tokens": 16, "response_tokens": 4, "group_size": 2, "seed": 0, "batch": 2, "checkpoint": False}
    result = peers_worker.run_config(config)
    assert result["status"] == "not installed" and "prefix-grouper" in result["error"]


def _row(id_, peer, plan=None, peak=0.0, time_s=1.0, status="ok"):
    return {"id": id_, "label": id_, "peer": peer, "plan": plan, "status": status, "peak_bytes": peak * 2**20,
            "time_s": time_s, "cpu_pressure": 0.0}


def test_strongest_peer_ratios():
    results = [_row("longstraw-detach", "longstraw", "detach", 200, 4.0),
               _row("longstraw-exact", "longstraw", "exact", 250, 5.0),
               {**_row("longstraw-exact-keep", "longstraw", "exact", 400, 4.0), "keep_prompt_graph": 2},
               _row("trl-b8", "trl", peak=3000, time_s=15.0),
               _row("trl-b1x8-ckpt", "trl", peak=500, time_s=20.0),
               _row("prefix-grouper", "prefix_grouper", peak=1500, time_s=4.5),
               _row("prefix-grouper-ckpt", "prefix_grouper", status="not installed")]
    summary = summarize(results)
    assert summary["time_over_exact"]["trl-b8"] == pytest.approx(3.0)
    memory, time_ = summary["strongest_peer_memory"], summary["strongest_peer_time"]
    assert memory["id"] == "trl-b1x8-ckpt" and memory["peer_over_longstraw"] == {"detach": 2.5, "exact": 2.0,
                                                                                 "exact+keep": 1.25}
    assert time_["id"] == "prefix-grouper" and time_["peer_over_longstraw"]["exact"] == pytest.approx(0.9)
    assert time_["peer_over_longstraw"]["exact+keep"] == pytest.approx(4.5 / 4.0)
    table = format_table({"results": results, "summary": summary})
    assert "lowest-memory peer configuration: trl-b1x8-ckpt (500.0 MiB); its peak / LongStraw's: detach 2.50, " \
           "exact 2.00" in table
    assert "fastest peer configuration: prefix-grouper (4.50 s); its time / LongStraw's: detach 1.12, exact 0.90" \
           in table
    assert "not installed" in table


@pytest.mark.skipif(not HAVE_PREFIX_GROUPER, reason="Prefix Grouper is optional: pip install prefix-grouper")
def test_prefix_grouper_path_gives_backward_groups_gradient():
    """The peer measures the same loss on the same group: float64, its gradient equals backward_group's."""
    from helpers import EXACT_F64, assert_close, faithful_float64

    from benchmarks.peers_worker import prefix_grouper_logprobs, prepare_prefix_grouper
    from benchmarks.worker import make_group
    from longstraw import backward_group, load_model
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.loss.terms import GroupTotals, response_loss

    p, r, g = 40, 6, 3
    reference = faithful_float64(load_model("tiny-llama", dtype="float64"))
    group = make_group(reference.config.vocab_size, p, r, g, seed=1)
    backward_group(reference, group, plan="standard")
    model = faithful_float64(load_model("tiny-llama", dtype="float64"))
    prepare_prefix_grouper(model)
    logp = prefix_grouper_logprobs(model, group.prompt, torch.stack(group.responses), token_chunk=7)
    cfg = LossConfig("grpo")
    response_loss(logp, torch.ones_like(logp, dtype=torch.bool), group.advantages, GroupTotals.of([r] * g, cfg),
                  cfg).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert_close(f"a.grad {name}", b.grad, a.grad, EXACT_F64)


# ---------------------------------------------------------------- timing runs and busy-loop neighbours


def _neighbour_pids() -> set[int]:
    """Live busy-loop children of this process (from /proc: pid, parent, command line)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if int(ppid) == os.getpid() and BUSY_LOOP.encode() in cmdline and state != "Z":
            found.add(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True  # killed and reaped: no zombie left behind
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_busy_neighbours_start_n_processes_and_kill_them_even_when_the_body_raises():
    with busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        assert {p.pid for p in procs} <= _neighbour_pids()
    assert all(p.returncode is not None and _gone(p.pid) for p in procs)
    with pytest.raises(KeyboardInterrupt):
        with busy_neighbours(1) as procs:
            raise KeyboardInterrupt
    assert procs[0].returncode is not None and _gone(procs[0].pid)
    with busy_neighbours(0) as procs:
        assert procs == []
    with pytest.raises(ValueError):
        with busy_neighbours(-1):
            pass


def test_worker_env_peak_run_fixes_the_threshold_timing_run_removes_it():
    users = {"PATH": "/bin", "MALLOC_MMAP_THRESHOLD_": "999", "OMP_WAIT_POLICY": "PASSIVE"}
    peak, timing = worker_env(peers.PEAK_THRESHOLD, base=users), worker_env(TIMING_THRESHOLD, base=users)
    assert peak["MALLOC_MMAP_THRESHOLD_"] == str(128 * 1024) and "MALLOC_MMAP_THRESHOLD_" not in timing
    assert peak["OMP_WAIT_POLICY"] == timing["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_NUM_THREADS" not in timing
    assert worker_env(0, smoke=True, base={})["OMP_NUM_THREADS"] == "1"
    assert users["MALLOC_MMAP_THRESHOLD_"] == "999"  # the caller's mapping is not changed


def test_each_configuration_has_a_peak_run_then_a_timing_run(tmp_path, monkeypatch, capsys):
    """The full (not smoke) path without running a model: workers replaced by a stand-in that records each run's
    environment and the neighbours alive meanwhile, and answers with a time depending on the allocator."""
    runs: list[dict] = []
    real_run = subprocess.run

    def worker(cmd, *args, env=None, **kwargs):
        if cmd[:2] != [sys.executable, "-m"]:  # not a worker (e.g. a library probing the machine)
            return real_run(cmd, *args, env=env, **kwargs)
        fixed = "MALLOC_MMAP_THRESHOLD_" in env
        runs.append({"module": cmd[2], "threshold": env.get("MALLOC_MMAP_THRESHOLD_"),
                     "neighbours": len(_neighbour_pids()) if os.path.isdir("/proc/self") else 1})
        peer = json.loads(cmd[3]).get("peer")
        if peer == "trl" and not fixed:  # the TRL row's timing run fails
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nMemoryError")
        measured = {"peak_bytes": (300 if fixed else 900) * 2**20, "time_s": 5.0 if fixed else 4.0,
                    "cpu_time_s": 8.0, "cpu_pressure": 0.5 if fixed else 0.6, "hwm_reset": True, "loss": 0.0,
                    "malloc_mmap_threshold": env.get("MALLOC_MMAP_THRESHOLD_")}
        if peer:  # the peers' worker prints its status; LongStraw's worker does not
            measured["status"] = "ok"
        return subprocess.CompletedProcess(cmd, 0, json.dumps(measured) + "\n", "")

    monkeypatch.setattr(subprocess, "run", worker)
    shape = SHAPES["b1"]
    rows = configurations(shape.group_size)
    rows = [rows[1], next(c for c in rows if c.peer == "trl"),
            Configuration("pg-3", "Prefix Grouper (bad)", "prefix_grouper")]
    real_run_peer = peers.run_peer

    def run_peer_stub(shape_, row, *args, **kwargs):
        if row.id == "pg-3":  # its peak run fails: no timing run
            return {"status": "failed", "error": "exit status 1"}
        return real_run_peer(shape_, row, *args, **kwargs)

    monkeypatch.setattr(peers, "run_peer", run_peer_stub)
    doc = run_peers_bench(shape, str(tmp_path / "peers.json"), timeout_s=60, rows=rows, neighbours=1)
    assert [(r["module"], r["threshold"]) for r in runs] == [
        ("benchmarks.worker", "131072"), ("benchmarks.worker", None),
        ("benchmarks.peers_worker", "131072"), ("benchmarks.peers_worker", None)]
    assert all(r["neighbours"] == 1 for r in runs) and not _neighbour_pids()
    exact, trl, bad = doc["results"]
    assert exact["peak_bytes"] == 300 * 2**20 and exact["time_s"] == 4.0 and exact["time_fixed_threshold_s"] == 5.0
    assert exact["cpu_pressure"] == 0.6 and exact["cpu_pressure_fixed_threshold"] == 0.5
    assert exact["malloc_mmap_threshold"] == "131072"  # the peak run's
    assert exact["timing_run"]["status"] == "ok" and exact["timing_run"]["peak_bytes"] == 900 * 2**20
    assert exact["timing_run"]["malloc_mmap_threshold"] is None
    assert trl["status"] == "ok" and trl["peak_bytes"] == 300 * 2**20 and trl["time_s"] is None
    assert trl["timing_run"]["status"] == "failed" and "MemoryError" in trl["timing_run"]["error"]
    assert bad["status"] == "failed" and "timing_run" not in bad
    assert doc["neighbours"] == 1 and "busy-loop neighbour" in doc["notes"][0]
    assert doc["summary"]["time_over_exact"] == {"longstraw-exact": 1.0}  # TRL has no time
    assert doc["summary"]["strongest_peer_memory"]["id"] == trl["id"]
    assert "strongest_peer_time" not in doc["summary"]
    table = format_table(doc)
    assert "busy-loop neighbours: 1; OMP_WAIT_POLICY: " in table.splitlines()[0]
    assert "glibc's default allocator" in table and "fixed at 128 KiB" in table
    trl_line = next(line for line in table.splitlines() if line.startswith(trl["label"]))
    assert trl_line.split()[-5:] == ["300.0", "-", "-", "5.00", "3.44"], trl_line  # 3.44: TRL's FLOPs / exact's
    assert "no time: timing run FAILED" in capsys.readouterr().err


def test_combine_runs_without_timing_run_keeps_the_peak_runs_result():
    peak = {"status": "ok", "peak_bytes": 1.0, "time_s": 2.0, "cpu_pressure": 0.0}
    assert combine_runs(peak, None) == peak
    failed = {"status": "failed", "error": "x"}
    assert combine_runs(failed, {"status": "ok", "time_s": 1.0}) == failed


def test_neighbours_option_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        main(["peers", "--neighbours", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_timing_run_really_runs_with_glibcs_default_allocator(tmp_path, workers_see_this_checkout):
    """Two real workers (LongStraw exact at the smoke shape, not smoke mode): each reports the threshold it saw."""
    shape = SHAPES["smoke"]
    exact = configurations(shape.group_size)[1]
    (entry,) = run_peers_bench(shape, str(tmp_path / "peers.json"), timeout_s=300, rows=[exact])["results"]
    assert entry["status"] == "ok" and entry["malloc_mmap_threshold"] == str(128 * 1024), entry
    assert entry["timing_run"]["status"] == "ok" and entry["timing_run"]["malloc_mmap_threshold"] is None
    assert entry["time_s"] == entry["timing_run"]["time_s"] > 0 and entry["time_fixed_threshold_s"] > 0


def test_only_runs_the_configurations_named(tmp_path, capsys, workers_see_this_checkout):
    out = tmp_path / "peers.json"
    assert main(["peers", "--smoke", "--only", "longstraw-exact-keep", "longstraw-exact", "--out",
                 str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["id"] for r in doc["results"]] == ["longstraw-exact-keep", "longstraw-exact"]
    assert [r["keep_prompt_graph"] > 0 for r in doc["results"]] == [True, False]  # the summary names rows by it
    assert doc["results"][0]["stats"]["keep_prompt_graph"] > 0 and doc["results"][1]["stats"]["keep_prompt_graph"] == 0
    with pytest.raises(SystemExit):
        main(["peers", "--smoke", "--only", "trl-b7"])
    assert "unknown configuration(s) trl-b7" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_ends_the_bench_and_its_busy_neighbours(tmp_path, signum):
    """`timeout` sends SIGTERM, Ctrl-C SIGINT: the bench stops with one line and status 128 + signal, its
    busy-loop neighbours end with it instead of running forever, and the configurations finished before the signal
    are announced in the `.tmp` file that holds them."""
    code = "import sys; from benchmarks.__main__ import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=IMPORT_PATH)
    out = tmp_path / "peers.json"
    partial = tmp_path / "peers.json.tmp"
    # SIGINT at its default in the bench: a shell without job control starts background commands (and so this test
    # runner) with SIGINT ignored, which the bench would inherit and honour.
    proc = subprocess.Popen([sys.executable, "-c", code, "peers", "--smoke", "--neighbours", "2",
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    busy: list[int] = []
    deadline = time.monotonic() + 120
    # SIGTERM once a configuration has finished (its .tmp announced); SIGINT as soon as the neighbours run.
    wait_for_partial = signum == signal.SIGTERM
    while (len(busy) < 2 or (wait_for_partial and not partial.exists())) and time.monotonic() < deadline \
            and proc.poll() is None:
        busy = [c for c in child_pids(proc.pid) if BUSY_LOOP in Path(f"/proc/{c}/cmdline").read_text()]
        time.sleep(0.02)
    assert len(busy) == 2, "the bench did not start its two neighbours"
    assert partial.exists() or not wait_for_partial, "the bench wrote no .tmp file of finished configurations"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err
    if partial.exists():
        finished = len(json.loads(partial.read_text())["results"])
        assert finished >= 1 and not out.exists()
        assert f"{finished} configuration(s) finished before it stopped; their results are in {partial}" in err
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in busy) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in busy)


@pytest.mark.parametrize("argv,match", [
    (["peers", "--smoke", "--out", "{tmp}"], "is a directory: give the results file's path"),
    (["decode", "--smoke", "--device", "cuda"], "no CUDA GPU"),
    (["decode", "--smoke", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["memory", "--smoke", "--out", "{tmp}"], "is a directory"),
    (["trl-scale", "--smoke", "--out", "{tmp}"], "is a directory: give the results file's path"),
    (["memory", "--smoke", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["prompt", "--smoke", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["pareto", "--smoke", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["cp", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["trl-scale", "--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
])
def test_bench_options_fail_before_any_work(tmp_path, capsys, argv, match):
    """One line from argparse (exit 2), no traceback, nothing written."""
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit) as stop:
        main([*[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    assert stop.value.code == 2
    assert match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
