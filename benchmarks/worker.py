"""One benchmark configuration in a fresh process: `python -m benchmarks.worker '<json config>'`.

Runs a single `backward_group` call (no warm-up: a warm-up would raise the high-water mark before the
measurement) and prints one JSON line on stdout. Peak memory follows docs/design.md §5: on CPU, VmHWM minus VmRSS
just before the step, with the high-water mark reset first through /proc/self/clear_refs; on CUDA,
`max_memory_allocated()` after a reset minus `memory_allocated()` before the step. Failures exit non-zero
with a traceback on stderr, which the parent records.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch

from benchmarks.common import load_bench_model
from benchmarks.launch import worker_args
from longstraw import Group, backward_group
from longstraw.peak import PeakMemory

# Keys a config must carry; the parent (`benchmarks/common.py`: `worker_config`) writes them all.
CONFIG_KEYS = (
    "model", "dtype", "device", "prompt_tokens", "response_tokens", "group_size", "plan", "chunk_size",
    "micro_batch", "seed", "checkpoint",
)


def cpu_pressure(stall0: int | None, stall1: int | None, seconds: float) -> float | None:
    """The share of `seconds` during which some runnable task waited for a CPU, from two `_cpu_stall_us` readings."""
    return None if stall0 is None or stall1 is None else min(1.0, (stall1 - stall0) / 1e6 / seconds)


def _cpu_stall_us() -> int | None:
    """Cumulative microseconds some runnable task waited for a CPU, system-wide (PSI, Linux >= 4.20)."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def make_group(
    vocab_size: int, prompt_tokens: int, response_tokens: int, group_size: int, seed: int, turns: int = 1,
    observation_tokens: int = 0,
) -> Group:
    """Deterministic random group: prompt (P,), G responses of exactly R ids, advantages ~ N(0, 1) (G,).
    Multi-turn (observation_tokens > 0): each response is `turns` turns of R generated ids and O observation ids,
    (turns * (R + O),), with loss masks False on the observations.

    The same seed gives the same group for every plan, so plans are compared on identical inputs.
    """
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen)
    length = turns * (response_tokens + observation_tokens)
    responses = [torch.randint(0, vocab_size, (length,), generator=gen) for _ in range(group_size)]
    advantages = torch.randn(group_size, generator=gen)
    masks = None
    if observation_tokens:
        turn = torch.cat([torch.ones(response_tokens, dtype=torch.bool),
                          torch.zeros(observation_tokens, dtype=torch.bool)])  # (R + O,): one turn's mask
        masks = [turn.repeat(turns) for _ in range(group_size)]
    return Group(prompt=prompt, responses=responses, advantages=advantages, loss_masks=masks)


def _step(model: torch.nn.Module, group: Any, config: dict[str, Any]) -> Any:
    """One `backward_group` of the configuration."""
    return backward_group(
        model, group, plan=str(config["plan"]), chunk_size=int(config["chunk_size"]),
        micro_batch=int(config["micro_batch"]), checkpoint=str(config["checkpoint"]),
        offload_state=bool(config.get("offload_state", False)) and config["plan"] in ("detach", "exact"),
        keep_prompt_graph=int(config.get("keep_prompt_graph", 0)) if config["plan"] == "exact" else 0,
    )


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """Build the model and group, run one measured `backward_group`, return the measurement."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"worker config is missing {', '.join(missing)}")
    device = str(config["device"])
    model = load_bench_model(str(config["model"]), str(config["dtype"]), device)
    if int(config.get("max_positions") or 0):  # a measurement past the trained context (bench --max-positions)
        model.config.max_position_embeddings = int(config["max_positions"])
    group = make_group(
        model.config.vocab_size, int(config["prompt_tokens"]), int(config["response_tokens"]),
        int(config["group_size"]), int(config["seed"]), int(config.get("turns", 1)),
        int(config.get("observation_tokens", 0)),
    )
    on_cuda = torch.device(device).type == "cuda"
    # Drop garbage from model construction so it is neither in the baseline nor freed mid-step.
    gc.collect()
    meter = PeakMemory(device)
    meter.start()

    stall0 = _cpu_stall_us()
    t0, c0 = time.perf_counter(), time.process_time()
    result = _step(model, group, config)
    if on_cuda:
        torch.cuda.synchronize(device)
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    stall1 = _cpu_stall_us()
    # Share of the step during which runnable tasks queued for a CPU: near 0 on an idle host; high values
    # mean other processes competed for the cores and the wall time is inflated (peaks are unaffected).
    pressure = cpu_pressure(stall0, stall1, step_s)

    high = meter.peak_absolute_bytes()
    peak = meter.peak_bytes()
    warm = _warm_steps(model, group, config, int(config.get("warm_steps", 0)))
    first = {"time_s": step_s, "cpu_time_s": cpu_s, "cpu_pressure": pressure}
    if warm:  # the fastest warm step is the step's time (the cold first one stays in `first_step`)
        step_s, cpu_s, pressure = min(warm)
    return {
        "peak_bytes": peak,
        "baseline_bytes": meter.base,
        "high_water_bytes": high,
        "peak_source": "cuda.max_memory_allocated" if on_cuda else "VmHWM",
        "hwm_reset": meter.reset_ok,
        "time_s": step_s,
        # CPU seconds of all this process's threads: less sensitive than wall time to other load on the host.
        "cpu_time_s": cpu_s,
        "cpu_pressure": pressure,
        "loss": result.loss,
        "stats": result.stats,
        "torch_threads": torch.get_num_threads(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "first_step": first,
        "warm_steps": [list(w) for w in warm],
    }


def _warm_steps(model: torch.nn.Module, group: Any, config: dict[str, Any],
                count: int) -> list[tuple[float, float, float | None]]:
    """`count` more steps after the measured one, each from fresh gradients: (wall s, CPU s, CPU pressure) each."""
    steps: list[tuple[float, float, float | None]] = []
    for _ in range(count):
        model.zero_grad(set_to_none=True)
        stall0 = _cpu_stall_us()
        t0, c0 = time.perf_counter(), time.process_time()
        _step(model, group, config)
        wall = time.perf_counter() - t0
        steps.append((wall, time.process_time() - c0, cpu_pressure(stall0, _cpu_stall_us(), wall)))
    return steps


def main(argv: list[str] | None = None) -> int:
    """One config (a JSON object) or several run one after another (a JSON list, `--smoke` runs: one process
    start instead of one per configuration; each peak is still measured from a reset high-water mark).
    A failure prints its traceback and exits 1: the parent records it and restarts for the rest."""
    args = worker_args(argv, "python -m benchmarks.worker '<json config or list of configs>'", 1)
    if args is None:
        return 2
    configs = json.loads(args[0])
    for config in configs if isinstance(configs, list) else [configs]:
        measurement = run_config(config)
        # One line per config, flushed: the parent reads the JSON lines of stdout in order.
        print(json.dumps(measurement), flush=True)
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
