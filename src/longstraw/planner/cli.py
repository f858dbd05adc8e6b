"""`longstraw plan`'s command line: options (`add_arguments`), `PlanInputs` from them, the table (`format_plan`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any

from longstraw.choices import PACKAGED_MODELS, PRESET_NAMES
from longstraw.plan import PLANS
from longstraw.planner.estimator import DTYPE_BYTES, PlanInputs, estimate, plan_all
from longstraw.planner.families import spec_from_config
from longstraw.planner.parsing import non_negative_int, parse_size, positive_int
from longstraw.planner.spec import BUILTIN_NAMES, load_config
from longstraw.planner.tree import TREE_ONLY, add_tree_arguments
from longstraw.planner.tree import run_from_args as run_tree_from_args


def add_arguments(parser) -> None:
    """Options of `longstraw plan`."""
    parser.add_argument("--model", required=True,
                        help=f"a built-in description ({', '.join(BUILTIN_NAMES)}), a preset "
                             f"({', '.join(PRESET_NAMES)}), a packaged model ({', '.join(PACKAGED_MODELS)}), a "
                             "directory with config.json, a config.json file, or a hub id")
    parser.add_argument("--prompt-tokens", type=positive_int, required=True, help="P")
    parser.add_argument("--response-tokens", type=positive_int, required=True,
                        help="R (every response): generated tokens, or an agent's whole response")
    parser.add_argument("--observation-tokens", type=non_negative_int, default=0,
                        help="tokens an environment appends to each response (an agent's tool results): in the "
                             "response's forward, activations and K/V like R (added to it), masked from the loss "
                             "(default 0)")
    parser.add_argument("--group-size", type=positive_int, required=True, help="G")
    parser.add_argument("--gpus", type=positive_int, default=1, help="GPUs sharing the step (default 1)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 96GB or 80GiB (default 80GB)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="parameter dtype")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree of the prompt state")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel degree: GPUs holding the model split by heads (weights, K/V and the "
                             "output projection's rows / tp per GPU; longstraw train --tp)")
    parser.add_argument("--no-shard", action="store_true", help="replicate weights/grads/optimizer (no FSDP)")
    parser.add_argument("--fsdp-gather", choices=("all", "layer"), default="all",
                        help="how FSDP gathers parameters for detach/exact (LongStraw's sharded_compute): all "
                             "(default: the whole model and the full gradient through the step; processes may do "
                             "different work) or layer (a decoder layer at a time; needs --cp equal to --gpus, the "
                             "TRL drop-in's longstraw_fsdp_gather='layer')")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="responses replayed at once")
    parser.add_argument("--chunk-size", type=positive_int, default=2048, help="prompt chunk (capture/backward)")
    parser.add_argument("--token-chunk", type=positive_int, default=1024, help="rows per log-prob block")
    parser.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                        help="adamw: fp32 moments (+ fp32 master weights for bf16/fp16)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default) or cpu: sets the runtime reserve")
    parser.add_argument("--reserve", help="per-GPU bytes outside the tensors (default 2GiB on cuda, 20MiB on cpu)")
    parser.add_argument("--checkpoint-layers", action="store_true",
                        help="per-layer activation checkpointing (keeps each layer's input only; "
                             "backward_group(checkpoint='layers'), longstraw train --checkpoint-layers)")
    parser.add_argument("--offload-state", action="store_true",
                        help="prompt state and its gradient in host memory, one layer's part on the GPU at a time "
                             "(backward_group(offload_state=True)); saves GPU memory with --checkpoint-layers")
    parser.add_argument("--keep-prompt-graph", type=non_negative_int, default=0, metavar="N",
                        help="exact: keep the last N capture chunks' graphs for the prompt backward instead of "
                             "recomputing them (backward_group(keep_prompt_graph=N)): faster, their activations "
                             "held through the replays")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_tree_arguments(parser)  # --tree: a prefix-tree step (planner/tree.py)


def inputs_from_args(args) -> PlanInputs:
    """PlanInputs from parsed options; raises ValueError on a bad size or combination."""
    if args.prompt_tokens < 2:
        raise ValueError("--prompt-tokens must be >= 2 (detach/exact capture all but the last prompt token)")
    if args.cp > args.gpus:
        raise ValueError(f"--cp {args.cp} needs at least as many GPUs (--gpus {args.gpus})")
    if args.gpus % (args.cp * args.tp):
        raise ValueError(f"--tp {args.tp} x --cp {args.cp} needs --gpus to be a multiple of {args.cp * args.tp}, got "
                         f"{args.gpus}")
    return PlanInputs(
        prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens + args.observation_tokens,
        observation_tokens=args.observation_tokens, group_size=args.group_size,
        dtype=args.dtype, gpus=args.gpus, gpu_memory=parse_size(args.gpu_memory), cp=args.cp, tp=args.tp,
        shard=not args.no_shard, micro_batch=args.micro_batch, chunk_size=args.chunk_size,
        token_chunk=args.token_chunk, optimizer=args.optimizer, device=args.device,
        reserve=parse_size(args.reserve) if args.reserve else None, checkpoint_layers=args.checkpoint_layers,
        offload_state=args.offload_state, keep_prompt_graph=args.keep_prompt_graph, fsdp_gather=args.fsdp_gather,
    )


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def format_plan(document: dict[str, Any], other_gather: dict[str, dict[str, Any]] | None = None) -> str:
    """The table: one row per component, one column per plan (GB = 10^9 bytes), then total, fits, largest P, the
    offloaded state's host memory, and last one verdict line (`verdict`; `other_gather`: see there)."""
    plans: dict[str, dict] = document["plans"]
    inp: dict = document["inputs"]
    model: dict = document["model"]
    names = list(plans)
    rows = list(dict.fromkeys(key for est in plans.values() for key in est["components"]))
    width = max(len(r) for r in rows + ["largest prompt (tokens)"]) + 1

    def row(label: str, cells: Iterable[str]) -> str:
        """One line of the table: `label`, then a cell per plan."""
        return f"{label:<{width}}" + "".join(f"{cell:>18}" for cell in cells)

    head = row("per GPU, GB", names)
    gather = "every parameter" if inp.get("fsdp_gather", "all") == "all" else "a layer"
    setup = (f"P={inp['prompt_tokens']} R={inp['response_tokens']}"
             + (f" (of which {inp['observation_tokens']} observation tokens)" if inp.get("observation_tokens") else "")
             + f" G={inp['group_size']} {inp['dtype']}, {inp['gpus']} GPU(s) x {inp['gpu_memory'] / 1e9:.1f} GB, "
             f"cp={inp['cp']}, " + (f"tp={inp['tp']}, " if inp.get("tp", 1) > 1 else "")
             + (f"FSDP/ZeRO-3 (LongStraw's plans gather {gather} at a time)" if inp["shard"]
                and inp["gpus"] > inp.get("tp", 1) else "no sharding")
             + f", micro-batch {inp['micro_batch']}, chunk {inp['chunk_size']}"
             + (", per-layer activation checkpointing" if inp["checkpoint_layers"] else "")
             + (", prompt state offloaded to host memory" if inp.get("offload_state") else "")
             + (f", exact keeps the last {inp['keep_prompt_graph']} capture graph(s)"
                if inp.get("keep_prompt_graph") else ""))
    lines = [f"{model['name']} ({model['model_type']}, {model['params'] / 1e9:.2f}B params, layers "
             + ", ".join(f"{k}x{v}" for k, v in model["layer_kinds"].items()) + ")", setup, head, "-" * len(head)]
    lines += [row(key, (_gb(plans[n]["components"].get(key)) for n in names)) for key in rows]
    lines += ["-" * len(head), row("peak (total)", (_gb(plans[n]["total_bytes"]) for n in names)),
              row("peak phase", (plans[n]["peak_phase"] for n in names)),
              row("fits", ("yes" if plans[n]["fits"] else "NO" for n in names))]
    positions = inp["prompt_tokens"] + inp["response_tokens"]
    if model.get("max_positions") and positions > model["max_positions"]:
        lines.append(f"NO for every plan: P + R = {positions:,} positions exceeds the model's max_position_embeddings "
                     f"({model['max_positions']:,}), which LongStraw refuses; use a longer-context model")
    largest = [plans[n]["largest_prompt_tokens"] for n in names]
    lines.append(row("largest prompt (tokens)", ("none" if x is None else f"{x:,}" for x in largest)))
    if any(plans[n].get("host_bytes") for n in names):
        lines.append(row("host memory, GB", (_gb(plans[n].get("host_bytes") or None) for n in names)))
        lines.append("host memory: the offloaded prompt state and its gradient, per GPU's process (not in the peak)")
    lines.append("peak = weights + optimizer + runtime (+ FSDP gather) + the largest phase; a phase holds the "
                 "resident gradients/state plus its own transient rows (every row is on the GPU within its phase)")
    lines.append(verdict(document, other_gather))
    return "\n".join(lines)


def _and(items: list[str], word: str = "and") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {word} " + items[-1]


def verdict(document: dict[str, Any], other_gather: dict[str, dict[str, Any]] | None = None) -> str:
    """One line: which plans fit the GPUs, at what per-GPU peak; for those that do not, their peak and the largest
    prompt that fits. `other_gather`: detach's and exact's estimates (`PlanEstimate` as dicts) under the other
    `--fsdp-gather` setting, named where it changes whether they fit."""
    plans: dict[str, dict] = document["plans"]
    inp: dict = document["inputs"]
    where = f"{inp['gpus']} x {inp['gpu_memory'] / 1e9:.1f} GB GPU" + ("s" if inp["gpus"] > 1 else "")
    fit = sorted((n for n in plans if plans[n]["fits"]), key=lambda n: plans[n]["total_bytes"])
    miss = [n for n in plans if not plans[n]["fits"]]
    text = f"verdict: a {inp['prompt_tokens']:,}-token prompt "
    if not any(plans[n].get("within_positions", True) for n in plans):
        return text + ("fits no plan: with the responses it exceeds the model's max_position_embeddings "
                       f"({document['model']['max_positions']:,}), which LongStraw refuses")
    if fit:
        fitted = [f"{n} ({_gb(plans[n]['total_bytes'])} GB per GPU)" for n in fit]
        text += f"fits {where} with {_and(fitted)}"
    else:
        low = min(plans, key=lambda n: plans[n]["total_bytes"])
        text += f"fits {where} with no plan (the lowest peak: {low}, {_gb(plans[low]['total_bytes'])} GB per GPU)"
    if miss and fit:
        missed = [f"{n} ({_gb(plans[n]['total_bytes'])} GB)" for n in miss]
        text += f"; not with {_and(missed, 'or')}"
    shorter = [f"{n} up to {plans[n]['largest_prompt_tokens']:,} tokens" for n in miss
               if plans[n]["largest_prompt_tokens"]]
    if shorter:
        text += f"; a shorter prompt fits {_and(shorter)}"
    if other_gather:
        flipped = [n for n, est in other_gather.items() if est["fits"] != plans[n]["fits"]]
        if flipped:
            other = "layer" if inp.get("fsdp_gather", "all") == "all" else "all"
            how = "a layer at a time" if other == "layer" else "every parameter"
            peaks = " / ".join(f"{_gb(other_gather[n]['total_bytes'])}" for n in flipped)
            does = "would fit" if other_gather[flipped[0]]["fits"] else "would not fit"
            text += (f"; gathering {how} (--fsdp-gather {other}) {_and(flipped)} {does} ({peaks} GB per GPU)")
    return text


def run_from_args(args) -> int:
    """Entry point of `longstraw plan`; bad input goes to the parser's error (exit 2)."""
    if getattr(args, "tree", False):
        return run_tree_from_args(args)
    given = [f"--{name.replace('_', '-')}" for name in TREE_ONLY if getattr(args, name, None) is not None]
    if given:
        args.fail(f"{', '.join(given)} describe a prefix tree: add --tree")
    try:
        inp = inputs_from_args(args)
        spec = spec_from_config(load_config(args.model), name=args.model)
    except ValueError as err:
        args.fail(str(err))
    document = plan_all(spec, inp)
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    other = None
    if inp.shard and inp.gpus > 1 and inp.cp == inp.gpus:  # both gatherings apply: say where the other differs
        switched = replace(inp, fsdp_gather="layer" if inp.fsdp_gather == "all" else "all")
        other = {plan.name: asdict(estimate(spec, switched, plan)) for plan in PLANS.values() if plan.captures_state}
    print(format_plan(document, other))
    return 0
