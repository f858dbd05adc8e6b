"""The drop-in's configuration: `LongStrawGRPOConfig` (TRL's `GRPOConfig` with LongStraw's fields), the
`BackwardOptions` and loss that make LongStraw's loss TRL's (docs/trl.md), and the refusals of what that loss cannot
reproduce, made when the trainer is built (`config_refusals`, `fsdp_refusals`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

try:
    from trl import GRPOConfig
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"longstraw.integrations.trl needs TRL: pip install 'longstraw[trl]' ({err})") from err

from longstraw.engine.loss.config import LossConfig
from longstraw.engine.options import BackwardOptions
from longstraw.plan import plan_named

_TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


@dataclass
class LongStrawOptions:
    """How LongStraw computes the gradient: the fields both TRL trainers' configs add (`LongStrawGRPOConfig`,
    `trl_async.LongStrawAsyncGRPOConfig`), each read through `option` (its default for a config without it)."""

    longstraw_plan: str = field(
        default="exact", metadata={"help": "backward_tree's plan: 'exact' (TRL's gradient, prompt encoded once), "
                                           "'detach' (the paper's cheaper plan: the prompt state is a constant, a "
                                           "biased gradient), 'standard' / 'standard_batched' (full sequences, the "
                                           "reference)."})
    longstraw_chunk_size: int = field(
        default=2048, metadata={"help": "Prompt tokens per capture chunk (and per prompt-backward chunk for exact)."})
    longstraw_micro_batch: int = field(default=1, metadata={"help": "Responses replayed at once."})
    longstraw_checkpoint: str | None = field(
        default=None, metadata={"help": "'none' or 'layers' (per-layer activation checkpointing); None follows "
                                        "`gradient_checkpointing`."})
    longstraw_offload_state: bool = field(
        default=False, metadata={"help": "Keep the prompt state in host memory (detach/exact)."})
    longstraw_keep_prompt_graph: int = field(
        default=0, metadata={"help": "exact: keep the last N capture chunks' graphs instead of recomputing them in "
                                     "the prompt backward (faster; their activations held through the replays)."})
    longstraw_tree_min_shared: int = field(
        default=1, metadata={"help": "Each micro-batch's rows run as one prefix tree (backward_tree), a token several "
                                     "rows share encoded once: the shortest run of tokens the tree splits off as a "
                                     "node of its own (shorter shared runs are encoded once per branch)."})


@dataclass
class LongStrawGRPOConfig(LongStrawOptions, GRPOConfig):
    """TRL's `GRPOConfig` plus how LongStraw computes the gradient. A plain `GRPOConfig` works too (these defaults)."""

    longstraw_cp: int = field(
        default=1, metadata={"help": "Context parallelism: blocks of this many consecutive processes exchange their "
                                     "groups and backpropagate each together, each process holding 1/C of every "
                                     "prompt's state (detach or exact plan; full-attention and recurrent layers). "
                                     "Must divide the number of processes."})
    longstraw_fsdp_gather: str = field(
        default="all", metadata={"help": "FSDP2: 'all' gathers every parameter once per micro-batch and holds the full "
                                         "gradient until one reduce-scatter (processes may do different work); "
                                         "'layer' gathers one decoder layer at a time through FSDP's hooks and "
                                         "reduce-scatters its gradient after each backward (needs longstraw_cp equal "
                                         "to the number of processes, so that every process runs the same forwards "
                                         "and backwards)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        backward_options(self)  # refused here, when the config is built, not after the first generation


_DEFAULTS = {f.name.removeprefix("longstraw_"): f.default for f in fields(LongStrawGRPOConfig)
             if f.name.startswith("longstraw_")}


def option(args: Any, name: str) -> Any:
    """`args.longstraw_<name>`, LongStrawGRPOConfig's default for a plain GRPOConfig; cp, tree_min_shared: ints >= 1."""
    value = getattr(args, f"longstraw_{name}", _DEFAULTS[name])
    if name in ("cp", "tree_min_shared") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{type(args).__name__}'s longstraw_{name} must be an integer >= 1, got {value!r}")
    return value


def backward_options(args: Any) -> BackwardOptions:
    """backward_tree's options from the config, validated by the engine; the loss: per micro-batch (`_loss_options`)."""
    checkpoint = option(args, "checkpoint")
    if checkpoint is None:
        checkpoint = "layers" if args.gradient_checkpointing else "none"
    try:
        options = BackwardOptions(plan=plan_named(option(args, "plan")), chunk_size=option(args, "chunk_size"),
                                  micro_batch=option(args, "micro_batch"), checkpoint=checkpoint,
                                  offload_state=option(args, "offload_state"),
                                  keep_prompt_graph=option(args, "keep_prompt_graph"), allow_train_mode=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{type(args).__name__}'s longstraw_* options: {err}") from None
    cp = option(args, "cp")
    if cp > 1 and not options.plan.supports_context_parallel:
        raise ValueError(f"LongStrawGRPOConfig's longstraw_cp={cp} shards the prompt state: use longstraw_plan "
                         f"'exact' or 'detach', not {options.plan.name!r}")
    if cp > 1 and options.keep_prompt_graph:
        raise ValueError("LongStrawGRPOConfig's longstraw_keep_prompt_graph is not supported with longstraw_cp > 1: "
                         "set it to 0")
    option(args, "tree_min_shared")
    gather = option(args, "fsdp_gather")
    if gather not in ("all", "layer"):
        raise ValueError(f"LongStrawGRPOConfig's longstraw_fsdp_gather must be 'all' or 'layer', got {gather!r}")
    return options


def loss_kind(args: GRPOConfig) -> str:
    """LongStraw's loss for TRL's loss_type: grpo with importance_sampling_level='sequence' is gspo, bnpo is dapo
    with the micro-batch's tokens as its denominator (`_loss_options`), the others are LongStraw's loss of the same
    name; the ratio's level of the others is `loss_parameters`'s sequence_ratio."""
    loss = args.loss_type
    if loss not in _TRL_LOSS_TYPES:
        raise ValueError(f"loss_type={loss!r} is not one LongStraw maps onto its losses ({', '.join(_TRL_LOSS_TYPES)})")
    if loss == "grpo" and args.importance_sampling_level == "sequence":
        return "gspo"
    return "dapo" if loss == "bnpo" else loss


def loss_parameters(args: GRPOConfig) -> dict[str, Any]:
    """backward_tree's loss options that TRL's config fixes (the per-micro-batch normalisers are `_loss_options`'s):
    the KL term, the ratio's level, and the clip widths (delta for the clipped losses only, as TRL; epsilon_high is
    cispo's cap ε_max itself in both) or the loss's own shape."""
    kind = loss_kind(args)
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    out: dict[str, Any] = dict(beta=args.beta, kl_ratio=bool(args.use_bias_correction_kl),
                               sequence_ratio=args.importance_sampling_level == "sequence")
    if kind == "cispo":
        out["epsilon_high"] = high
    elif kind == "sapo":
        out.update(sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg)
    elif kind == "vespo":
        out.update(vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
                   vespo_lambda_neg=args.vespo_lambda_neg)
    else:
        out.update(epsilon_low=args.epsilon, epsilon_high=high, delta=args.delta)
    return out


def work_of(batches: list[dict[str, Any]]) -> tuple[int, ...]:
    """What fixes the forwards and backwards `_backward_batches` runs on `batches`: rows, prompt and completion lengths,
    and which completion tokens the tool mask keeps."""
    out: list[int] = []
    for batch in batches:
        out.append(batch["completion_ids"].size(0))
        out.extend(batch["prompt_mask"].sum(1).tolist())
        out.extend(batch["completion_mask"].sum(1).tolist())
        if batch.get("tool_mask") is not None:
            out.extend(batch["tool_mask"].sum(1).tolist())
    return tuple(int(v) for v in out)


def steps_per_generation(args: GRPOConfig) -> int:
    """args.steps_per_generation: typed `int | None`, but GRPOConfig.__post_init__ always sets it."""
    steps = args.steps_per_generation
    assert steps is not None
    return steps


def config_refusals(args: GRPOConfig) -> list[str]:
    """Why this configuration cannot be trained with LongStraw's backward (empty: it can)."""
    out = []
    loss, level = args.loss_type, args.importance_sampling_level
    if level not in ("token", "sequence"):
        out.append(f"importance_sampling_level={level!r}: only 'token' and 'sequence' exist")
    elif loss not in _TRL_LOSS_TYPES:
        out.append(f"loss_type={loss!r} is not one LongStraw maps onto its losses ({', '.join(_TRL_LOSS_TYPES)})")
    else:
        try:  # the engine's checks of the loss options, here rather than at the first step
            LossConfig(loss_kind(args), **loss_parameters(args))
        except (TypeError, ValueError) as err:
            out.append(f"loss_type={loss!r} with these options: {err}")
    if loss == "bnpo" and args.num_generations and args.per_device_train_batch_size % args.num_generations:
        out.append(f"loss_type='bnpo' with per_device_train_batch_size ({args.per_device_train_batch_size}) not a "
                   f"multiple of num_generations ({args.num_generations}): bnpo divides by the tokens of a micro-batch "
                   "of per_device_train_batch_size rows, and the drop-in's micro-batches hold whole groups, so they "
                   "would not have that many rows (some more, some none)")
    if loss == "dr_grpo" and args.max_completion_length is None:
        out.append("loss_type='dr_grpo' needs max_completion_length (its normaliser)")
    if args.top_entropy_quantile < 1.0 or args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        out.append("top_entropy_quantile < 1, entropy_coef or use_adaptive_entropy: they need every token's entropy, "
                   "which LongStraw's log-prob kernel does not compute")
    if args.off_policy_mask_threshold is not None:
        out.append("off_policy_mask_threshold: off-policy sequence masking is not in LongStraw's losses")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        out.append("use_vllm with vllm_importance_sampling_correction=True: the per-token importance weights for "
                   "vLLM's sampling mismatch are not in LongStraw's losses; set vllm_importance_sampling_correction="
                   "False (vLLM generation itself is kept)")
    if args.fp16:
        out.append("fp16=True: Trainer's gradient scaler scales the loss it backpropagates, and LongStraw runs its own "
                   "backward; load the model in bfloat16 (or float32) and set fp16=False")
    if args.cast_lm_head_to_fp32:
        out.append("cast_lm_head_to_fp32=True: over bfloat16/float16 parameters it makes the LM head's weights float32 "
                   "and the rest not, a mixed-dtype model, which backward_tree refuses (it computes in the "
                   "parameters' one dtype, the log-probs accumulated in float32); over float32 parameters under bf16 "
                   "autocast TRL runs the head outside the autocast, which backward_tree's autocast region does not; "
                   "over float32 without autocast it changes nothing: set cast_lm_head_to_fp32=False")
    if args.fsdp:
        out.extend(fsdp_refusals(args.fsdp_plugin_args or {}))
    g, b = args.num_generations, args.per_device_train_batch_size
    s, spg = args.gradient_accumulation_steps, steps_per_generation(args)
    assert g is not None  # GRPOConfig.__post_init__ requires num_generations >= 2
    if (b * spg) % g:
        out.append(f"per_device_train_batch_size ({b}) x steps_per_generation ({spg}) is not a multiple of "
                   f"num_generations ({g}): a prompt's group would be split across processes or generation batches, "
                   "which cannot be put back together")
    elif spg % s and s % spg:
        out.append(f"steps_per_generation ({spg}) and gradient_accumulation_steps ({s}): neither divides the other, so "
                   "a generation batch's groups would straddle optimizer steps")
    elif spg > s and (b * s) % g:
        out.append(f"one generation batch feeds {spg // s} optimizer steps of per_device_train_batch_size ({b}) x "
                   f"gradient_accumulation_steps ({s}) sequences, not a multiple of num_generations ({g}): each step "
                   "must get whole groups")
    return out


def fsdp_refusals(plugin: Any) -> list[str]:
    """What LongStraw cannot run of an FSDP configuration: TrainingArguments' `fsdp_plugin_args` (a dict) or
    accelerate's `FullyShardedDataParallelPlugin` (an `accelerate launch` config file)."""
    get = plugin.get if isinstance(plugin, dict) else lambda name, default=None: getattr(plugin, name, default)
    out = []
    version = get("fsdp_version", 2)
    if version != 2:
        out.append(f"FSDP version {version}: LongStraw runs under FSDP2 (`fully_shard`), whose sharded modules it can "
                   "gather once per micro-batch; set fsdp_config={'version': 2} (accelerate: fsdp_version: 2)")
    offload = get("cpu_offload", False)  # TrainingArguments: a bool; the plugin: an FSDP2 offload policy
    if offload is True or type(offload).__name__ == "CPUOffloadPolicy" or getattr(offload, "offload_params", False):
        out.append("FSDP cpu_offload: not supported by LongStraw's gathered compute; keep the prompt state in host "
                   "memory instead (longstraw_offload_state=True)")
    if get("activation_checkpointing", False):
        out.append("FSDP activation_checkpointing wraps the decoder layers, which backward_tree runs itself; use "
                   "gradient_checkpointing=True (or longstraw_checkpoint='layers'): LongStraw's per-layer "
                   "checkpointing")
    return out


def refuse(reasons: list[str], trainer: str = "LongStrawGRPOTrainer") -> None:
    """ValueError listing every reason `trainer` cannot train this configuration (none: returns)."""
    if reasons:
        raise ValueError(f"{trainer} cannot train this configuration with LongStraw's backward:\n- "
                         + "\n- ".join(reasons))
