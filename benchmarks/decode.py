"""`python -m benchmarks decode`: sampling throughput from one long prompt's state, LongStraw against transformers'
`generate`.

What runs, in this process, for each prompt length P (the same random prompt, the same model weights, both sides
one after the other, the first side's state freed before the second starts):

* LongStraw. prefill: `capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=False)`, the prompt state
  the training step consumes (one copy, shared by the G samples). decode: `sampling.sample_group(model, prompt, G,
  SamplingConfig(max_new_tokens=N, temperature=1.0, stop_ids=()), state=state)`: G responses of exactly N tokens
  as one batch, every step attending to the shared state (never expanded) and to its own tokens. Prompt-cache
  bytes: `PromptState.nbytes()` (every tensor the state holds).
* transformers. prefill: one forward of prompt[:-1] into a `DynamicCache` under no_grad, with `logits_to_keep=1`
  (only the last position's logits, as `generate` computes in its own prefill; LongStraw's capture computes no
  logits at all; without it the forward would also materialise (P-1) x vocab logits, 16 GiB at P = 131,072 on
  b1-llama). Then `cache.batch_repeat_interleave(G)`: the cache copied G times, what batched sampling of G
  responses to one prompt costs in transformers. decode: `model.generate(prompt expanded to (G, P), cache=cache,
  attention_mask=ones, max_new_tokens=N, min_new_tokens=N, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
  eos_token_id=None, pad_token_id=0)`. Prompt-cache bytes: every tensor of the cache's layers after the repeat,
  before `generate` appends to it.

  Two of those arguments matter for a fair comparison. `attention_mask`: without it `generate` infers padding from
  `pad_token_id`, so every prompt position that holds token 0 (in a random prompt over a 32,000-token vocabulary:
  P = 8192 about 23% of prompts, P = 131,072 nearly all) would be masked out: other samples, and an explicit mask
  in every attention call. `top_k=0`: transformers' default `top_k` is 50; LongStraw samples from the full
  distribution, so transformers does too. The cache is passed under the name the model's forward takes
  (`architecture.cache_keyword`: `cache` from transformers 5.24, `past_key_values` up to 5.23); that the prefill filled
  it (P - 1 positions) is checked, not assumed.

Both decodes sample at temperature 1 from the unfiltered distribution, every response exactly N tokens (no stop
ids): the table checks that each side produced G x N tokens. tokens/s = G * N / decode wall time. That the two
decode the same model is tested (tests/benchmarks/test_decode.py: transformers' logits for its own samples equal
LongStraw's scoring of them; tests/engine/test_sampling.py: LongStraw's sampled log-probs equal a full forward).

Per phase (two prefills, two decodes): wall time, CPU time, CPU pressure (the share of the phase during which
some runnable task waited for a CPU, from /proc/pressure/cpu as `benchmarks/worker.py` records it; > 10% marks the host
busy and the time inflated) and the peak memory above the phase's start (`peak.PeakMemory`: on CUDA
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, also recorded absolute; on CPU VmHWM after a
reset, indicative only, since both sides run in one process and glibc reuses freed heap). A warm-up of both sides
on a 32-token prompt runs first, unrecorded (first-call costs: generate's setup, CUDA kernels).

Defaults: b1-llama, fp32, CPU, P in {8192, 32768, 131072}, G = 8, N = 32, chunk 2048 (~10 minutes on a 2-core
host, most of it both prefills at P = 131,072). The model's max_position_embeddings is raised to max P + N where
it is smaller (b1-llama's 131,072 is 32 short; RoPE needs no table). `--smoke`: tiny-llama, P in {64, 128}, G = 2,
N = 4, chunk 32: seconds, only that everything runs (used by the tests).

CUDA (`--device cuda --model gpu-llama-1b --dtype bfloat16`): the model is built on the GPU
(`common.load_bench_model`), every phase is bracketed by `torch.cuda.synchronize`, the peaks are
`max_memory_allocated`, and the cache allocator is emptied between the sides. That path has NOT been run on a GPU
yet (written and reviewed on a CPU-only host).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, NoReturn

from benchmarks.common import (
    BUSY_PRESSURE,
    MIB,
    RESULTS_FILE,
    SMOKE_NOTE,
    check_device,
    check_model,
    check_out,
    default_out,
    write_json,
    write_results,
)
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import DTYPES, PRESET_NAMES
from longstraw.planner import positive_int

WARMUP_PROMPT = 32  # tokens of the unrecorded warm-up prompt
WARMUP_NEW_TOKENS = 2
PAD_TOKEN_ID = 0  # transformers' generate wants one; the explicit attention mask keeps it from masking the prompt


@dataclass(frozen=True)
class DecodeShape:
    """What one run measures: every P in `prompts` with G = `group_size` responses of N = `new_tokens` tokens."""

    model: str
    prompts: tuple[int, ...]
    group_size: int
    new_tokens: int
    chunk_size: int  # LongStraw's capture chunk
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0


SHAPES = {
    "b1": DecodeShape("b1-llama", (8192, 32768, 131072), group_size=8, new_tokens=32, chunk_size=2048),
    "smoke": DecodeShape("tiny-llama", (64, 128), group_size=2, new_tokens=4, chunk_size=32),
}


# ---------------------------------------------------------------- measuring one phase


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn()` as one phase: its result and wall time, CPU time, CPU pressure and peak memory (module docstring).
    On CUDA the phase starts and ends with a synchronize, so the time covers the GPU work it queued."""
    from benchmarks.worker import _cpu_stall_us, cpu_pressure
    from longstraw.peak import PeakMemory

    gc.collect()
    _synchronize(device)
    meter = PeakMemory(device)
    meter.start()  # CUDA: synchronize, reset_peak_memory_stats, memory_allocated; CPU: VmHWM reset to VmRSS
    stall0 = _cpu_stall_us()
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    _synchronize(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stall1 = _cpu_stall_us()
    pressure = cpu_pressure(stall0, stall1, wall)
    return result, {
        "time_s": wall, "cpu_time_s": cpu, "cpu_pressure": pressure,
        "peak_bytes": meter.peak_bytes(), "peak_absolute_bytes": meter.peak_absolute_bytes(),
        "peak_source": "cuda.max_memory_allocated" if meter.cuda else "VmHWM", "hwm_reset": meter.reset_ok,
    }


def _release(device: str) -> None:
    """Free what the side before left (its state is deleted by the caller) so the two sides never stack."""
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the two sides


def cache_bytes(cache) -> int:
    """Bytes of every tensor a transformers cache's layers hold (DynamicLayer: keys and values; a recurrent layer's
    states too), counted from the tensors themselves."""
    import torch

    return sum(value.numel() * value.element_size() for layer in cache.layers for value in vars(layer).values()
               if isinstance(value, torch.Tensor))


def longstraw_side(model, prompt, shape: DecodeShape) -> dict[str, Any]:
    """LongStraw's prefill (`capture_prompt`) and decode (`sample_group` from that state), measured."""
    from longstraw.engine.sampling import SamplingConfig, sample_group
    from longstraw.engine.state.capture import capture_prompt

    state, prefill = measure(shape.device, lambda: capture_prompt(model, prompt[:-1], shape.chunk_size,
                                                                  keep_boundaries=False))
    state_bytes = state.nbytes()
    sampling = SamplingConfig(max_new_tokens=shape.new_tokens, temperature=1.0, stop_ids=())
    rollout, decode = measure(shape.device, lambda: sample_group(model, prompt, shape.group_size, sampling,
                                                                 seed=shape.seed, state=state))
    tokens = sum(int(r.numel()) for r in rollout.responses)
    return {"status": "ok", "prefill": prefill, "decode": decode, "cache_bytes": state_bytes,
            "tokens_generated": tokens, "tokens_per_s": tokens / decode["time_s"]}


def hf_generate(model, prompt, cache, group_size: int, new_tokens: int, seed: int, **extra):
    """transformers' `generate` of `group_size` samples of exactly `new_tokens` tokens from `prompt` (P,), continuing
    `cache` (which holds prompt[:-1] repeated `group_size` times); `extra` goes to `generate` (the tests ask for the
    logits). The explicit all-ones attention mask keeps `generate` from inferring padding at every prompt position
    that holds PAD_TOKEN_ID (module docstring)."""
    import torch

    from longstraw.models.architecture import cache_keyword

    ids = prompt[None].expand(group_size, -1)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                          eos_token_id=None, pad_token_id=PAD_TOKEN_ID, **{cache_keyword(model): cache}, **extra)


def hf_prefill(model, prompt):
    """prompt[:-1] into a fresh DynamicCache, one forward under no_grad, only the last position's logits."""
    import torch
    from transformers import DynamicCache

    from longstraw.models.architecture import cache_keyword

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[None, :-1], use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    if cache.get_seq_length() != prompt.numel() - 1:  # a kwarg the model did not take would leave it empty
        raise RuntimeError(f"the transformers prefill left {cache.get_seq_length()} positions in the cache, "
                           f"expected {prompt.numel() - 1}")
    return cache


def transformers_side(model, prompt, shape: DecodeShape) -> dict[str, Any]:
    """transformers' prefill (one forward into a DynamicCache), the cache repeated G times, `generate`, measured."""
    p = prompt.numel()
    cache, prefill = measure(shape.device, lambda: hf_prefill(model, prompt))
    cache.batch_repeat_interleave(shape.group_size)
    expanded_bytes = cache_bytes(cache)  # before generate appends
    out, decode = measure(shape.device, lambda: hf_generate(model, prompt, cache, shape.group_size,
                                                            shape.new_tokens, shape.seed))
    tokens = int(out[:, p:].numel()) if out.shape[0] == shape.group_size else 0
    return {"status": "ok", "prefill": prefill, "decode": decode, "cache_bytes": expanded_bytes,
            "tokens_generated": tokens, "tokens_per_s": tokens / decode["time_s"]}


def _side(fn: Callable[[], dict[str, Any]], device: str) -> dict[str, Any]:
    """One side, never raising: an error (out of memory included) is recorded and the run goes on."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - a bench records a failed side and measures the rest
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    finally:
        _release(device)


def make_prompt(vocab_size: int, p: int, seed: int, device: str):
    """The random prompt (P,) both sides decode from: the same for a given (P, seed)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + p)
    return torch.randint(0, vocab_size, (p,), generator=gen).to(device)


def measure_prompt(model, shape: DecodeShape, p: int) -> dict[str, Any]:
    """Both sides at prompt length p, and what the table compares."""
    prompt = make_prompt(model.config.vocab_size, p, shape.seed, shape.device)
    ours = _side(lambda: longstraw_side(model, prompt, shape), shape.device)
    theirs = _side(lambda: transformers_side(model, prompt, shape), shape.device)
    expected = shape.group_size * shape.new_tokens
    entry: dict[str, Any] = {"prompt_tokens": p, "expected_tokens": expected, "longstraw": ours,
                             "transformers": theirs}
    ok = ours["status"] == "ok" and theirs["status"] == "ok"
    entry["tokens_ok"] = ok and ours["tokens_generated"] == theirs["tokens_generated"] == expected
    entry["status"] = "ok" if entry["tokens_ok"] else "failed"
    if ok:
        entry["tokens_per_s_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]  # > 1: LongStraw faster
        entry["cache_bytes_ratio"] = theirs["cache_bytes"] / ours["cache_bytes"]  # ~G
        entry["prefill_time_ratio"] = theirs["prefill"]["time_s"] / ours["prefill"]["time_s"]  # > 1: ours faster
    return entry


def warm_up(model, shape: DecodeShape) -> None:
    """Both sides once on a short prompt, unrecorded (module docstring)."""
    small = replace(shape, new_tokens=WARMUP_NEW_TOKENS)
    prompt = make_prompt(model.config.vocab_size, WARMUP_PROMPT, shape.seed + 1, shape.device)
    longstraw_side(model, prompt, small)
    _release(shape.device)
    transformers_side(model, prompt, small)
    _release(shape.device)


# ---------------------------------------------------------------- the run


def busy_phases(entry: dict[str, Any]) -> list[str]:
    """The phases of one P whose CPU pressure exceeds BUSY_PRESSURE (their times are inflated)."""
    names = []
    for side in ("longstraw", "transformers"):
        for phase in ("prefill", "decode"):
            pressure = entry[side].get(phase, {}).get("cpu_pressure")
            if isinstance(pressure, float) and pressure > BUSY_PRESSURE:
                names.append(f"{side} {phase}")
    return names


def run_decode_bench(shape: DecodeShape, out: str, smoke: bool = False) -> dict[str, Any]:
    """Load the model, warm up, measure every P (progress on stderr, the JSON rewritten to `out`.tmp after each),
    write `out`; return the document."""
    import os

    import torch

    from benchmarks.common import load_bench_model

    if torch.device(shape.device).type == "cuda" and torch.device(shape.device).index is not None:
        torch.cuda.set_device(shape.device)  # PeakMemory's reset and reads use the current device
    model = load_bench_model(shape.model, shape.dtype, shape.device).eval()
    needed = max(shape.prompts) + shape.new_tokens
    trained = getattr(model.config, "max_position_embeddings", None)
    if trained is not None and trained < needed:
        model.config.max_position_embeddings = needed
    document: dict[str, Any] = {
        "bench": "decode", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": asdict(shape), "smoke": smoke,
        "max_position_embeddings": {"model": trained, "used": getattr(model.config, "max_position_embeddings", None)},
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "stop_ids": [],
                     "transformers_pad_token_id": PAD_TOKEN_ID, "transformers_attention_mask": "all ones"},
        "torch_threads": torch.get_num_threads(), "machine": machine_info(shape.device), "results": [],
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    print(f"{header(document)}; warming up", file=sys.stderr, flush=True)
    warm_up(model, shape)
    for index, p in enumerate(shape.prompts, 1):
        entry = measure_prompt(model, shape, p)
        document["results"].append(entry)
        print(f"[{index}/{len(shape.prompts)}] P={p}: {_progress(entry)}", file=sys.stderr, flush=True)
        write_json(out + ".tmp", document)
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    contended = {e["prompt_tokens"]: busy_phases(e) for e in document["results"] if busy_phases(e)}
    if contended and not smoke:
        document["notes"] = [f"P={p}: CPU pressure over {BUSY_PRESSURE:.0%} in {', '.join(phases)}: those times are "
                             "inflated by other processes" for p, phases in contended.items()]
    written = write_results(out, document, "bench decode")
    if written is not None:
        os.remove(out + ".tmp")
    document[RESULTS_FILE] = written  # for the caller's last line; not in the file
    return document


def _progress(entry: dict[str, Any]) -> str:
    parts = []
    for side, name in (("longstraw", "LongStraw"), ("transformers", "transformers")):
        r = entry[side]
        if r["status"] != "ok":
            parts.append(f"{name} FAILED: {r['error']}")
        else:
            parts.append(f"{name} prefill {r['prefill']['time_s']:.2f} s, decode {r['decode']['time_s']:.2f} s "
                         f"({r['tokens_per_s']:.1f} tok/s)")
    return "; ".join(parts)


# ---------------------------------------------------------------- the table


def header(document: dict[str, Any]) -> str:
    shape = document["shape"]
    machine = document.get("machine", {})
    return (f"bench decode: {shape['model']} {shape['dtype']} {shape['device']}, G={shape['group_size']} responses "
            f"x N={shape['new_tokens']} new tokens, capture chunk {shape['chunk_size']}; torch threads "
            f"{document.get('torch_threads')}; OMP_WAIT_POLICY: {machine.get('omp_wait_policy', 'unset')}")


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(float(value), fmt)


def _pressure(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0%}"


TABLE_NOTE = (
    "tok/s: G x N sampled tokens / decode wall time (LongStraw: sample_group from the shared prompt state; "
    "transformers: generate from a DynamicCache repeated G times); ratio: LongStraw / transformers (> 1: LongStraw "
    "faster); prefill: LongStraw's chunked capture_prompt, transformers' one forward into the cache; cache MiB: the "
    "prompt's cache as each side holds it for the G samples (x: transformers / LongStraw); pressure: CPU pressure "
    "during each decode (> 10%: other processes inflated the time); tokens: both sides produced G x N tokens")


def format_table(document: dict[str, Any]) -> str:
    """The header line, one Markdown row per P, what the columns measure."""
    import textwrap

    lines = [header(document), "",
             "| P | LongStraw tok/s | transformers tok/s | ratio | prefill s LongStraw | prefill s transformers "
             "| cache MiB LongStraw | cache MiB transformers | x | pressure LS / HF | decode peak MiB LS / HF "
             "| tokens |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for e in document["results"]:
        ours, theirs = e["longstraw"], e["transformers"]

        def get(side: dict[str, Any], *keys: str) -> Any:
            value: Any = side
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            return value

        cache = [None if get(s, "cache_bytes") is None else get(s, "cache_bytes") / MIB for s in (ours, theirs)]
        peaks = [None if get(s, "decode", "peak_bytes") is None else get(s, "decode", "peak_bytes") / MIB
                 for s in (ours, theirs)]
        failed = [f"{name} failed" for name, s in (("LongStraw", ours), ("transformers", theirs))
                  if s["status"] != "ok"]
        tokens = ", ".join(failed) if failed else (
            f"ok ({ours['tokens_generated']} + {theirs['tokens_generated']})" if e["tokens_ok"]
            else f"WRONG: {ours['tokens_generated']} / {theirs['tokens_generated']}, expected {e['expected_tokens']}")
        lines.append(
            f"| {e['prompt_tokens']} | {_num(get(ours, 'tokens_per_s'), '.1f')} "
            f"| {_num(get(theirs, 'tokens_per_s'), '.1f')} | {_num(e.get('tokens_per_s_ratio'), '.2f')} "
            f"| {_num(get(ours, 'prefill', 'time_s'), '.2f')} | {_num(get(theirs, 'prefill', 'time_s'), '.2f')} "
            f"| {_num(cache[0], '.1f')} | {_num(cache[1], '.1f')} | {_num(e.get('cache_bytes_ratio'), '.2f')} "
            f"| {_pressure(get(ours, 'decode', 'cpu_pressure'))} / {_pressure(get(theirs, 'decode', 'cpu_pressure'))} "
            f"| {_num(peaks[0], '.1f')} / {_num(peaks[1], '.1f')} | {tokens} |")
    lines.append("")
    lines.append(textwrap.fill(TABLE_NOTE, width=118))
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks decode`; unset ones take the shape's value (b1, or smoke with --smoke)."""
    b1 = SHAPES["b1"]
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama, P in {64, 128}, G=2, N=4, chunk 32: seconds, only that everything runs")
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a local directory or a Hugging "
                                        f"Face id (default {b1.model})")
    parser.add_argument("--dtype", choices=DTYPES, help=f"parameter dtype (default {b1.dtype})")
    parser.add_argument("--device", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--prompts", type=positive_int, nargs="+", metavar="P",
                        help=f"prompt lengths, each >= 2 (default {' '.join(map(str, b1.prompts))})")
    parser.add_argument("--group-size", type=positive_int, metavar="G",
                        help=f"responses sampled per prompt (default {b1.group_size})")
    parser.add_argument("--new-tokens", type=positive_int, metavar="N",
                        help=f"tokens sampled per response, exactly (default {b1.new_tokens})")
    parser.add_argument("--chunk-size", type=positive_int, help=f"LongStraw's capture chunk (default {b1.chunk_size})")
    parser.add_argument("--seed", type=int, help="seed of the random prompts and the sampling (default 0)")
    parser.add_argument("--out", help="result JSON (default bench/results/decode-<model>-<YYYYmmdd-HHMMSS>.json; "
                                      "smoke: under bench/results/smoke/)")


def shape_from_args(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> DecodeShape:
    """The shape (--smoke or b1) with every given option on top; `fail` reports a bad value and exits."""
    shape = SHAPES["smoke" if args.smoke else "b1"]
    overrides = {"model": args.model, "dtype": args.dtype, "device": args.device, "group_size": args.group_size,
                 "new_tokens": args.new_tokens, "chunk_size": args.chunk_size, "seed": args.seed,
                 "prompts": tuple(dict.fromkeys(args.prompts)) if args.prompts else None}
    shape = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    if min(shape.prompts) < 2:
        fail("--prompts: every P must be >= 2 (LongStraw captures prompt[:-1] and decodes from the last token)")
    check_device(shape.device, fail)
    check_model(shape.model, fail)
    check_out(args.out, fail)
    return shape


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks decode`: exit status 0 if every P ran on both sides with G x N tokens
    each."""
    shape = shape_from_args(args, args.fail)
    out = args.out or default_out(f"decode-{shape.model.replace('/', '_')}", args.smoke)
    document = run_decode_bench(shape, out, smoke=args.smoke)
    results: list[dict[str, Any]] = document["results"]
    if args.smoke:
        print(header(document))
        print("\n".join(f"P={e['prompt_tokens']}: {e['status']}" for e in results))
        print(SMOKE_NOTE)
    else:
        print(format_table(document))
    for note in document.get("notes", []):
        print(f"note: {note}")
    if document[RESULTS_FILE] is not None:
        print(f"results: {document[RESULTS_FILE]}")
    if not all(e["status"] == "ok" for e in results):
        print("bench decode: a prompt length failed or produced the wrong number of tokens; see the result file",
              file=sys.stderr)
        return 1
    return 0


BENCHMARKS = (
    Benchmark(
        name="decode", help="sampling throughput over a long prompt: LongStraw's shared state against transformers' "
                       "generate",
        description="Per prompt length: LongStraw (capture_prompt, then sample_group of G responses from the shared "
                    "state) against transformers (one forward into a DynamicCache repeated G times, then "
                    "generate): tokens/s, prefill times, prompt-cache bytes, CPU pressure; table and JSON.",
        add_arguments=add_arguments, run=run_from_args, table=format_table,
    ),
)
