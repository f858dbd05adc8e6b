"""`TrainConfig`: every training option as a typed field with help text, validated on construction.

Loadable from a TOML file (flat keys, the field names) and overridable on the command line: each field
becomes `--field-name` (booleans: `--flag` / `--no-flag`). `__post_init__` rejects bad values and bad
combinations with a message that says what to change.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longstraw.choices import (
    ADVANTAGES,
    DTYPES,
    LOSSES,
    LR_SCHEDULES,
    MIN_TEMPERATURE,
    PACKAGED_MODELS,
    PLANS,
    PRESET_NAMES,
    TASKS,
    did_you_mean,
)

if TYPE_CHECKING:
    from collections.abc import Callable

ROLLOUTS = ("group", "tree")
TREE_TRIGGERS = ("tool_call", "tokens")  # engine.tree.rollout.TRIGGERS, named here without importing torch
TREE_ADVANTAGES = ("grpo", "siblings")  # engine.tree.rollout.TREE_ADVANTAGES

if TYPE_CHECKING:
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.options import BackwardOptions
    from longstraw.engine.state.sharding import ContextShards


def _f(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    return field(default=default, metadata={"help": help})


def _need(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond holds."""
    if not cond:
        raise ValueError(message)


@dataclass
class TrainConfig:
    # model
    model: str = _f("tiny-qwen3", f"a preset (random weights: {', '.join(PRESET_NAMES)}), a packaged real model "
                                  f"({', '.join(PACKAGED_MODELS)}), a Hugging Face id (owner/name), a local directory "
                                  "or a .gguf file")
    dtype: str = _f("float32", "parameter dtype: float32, bfloat16, float64 (float16 is refused: AdamW without "
                               "loss scaling or float32 master weights turns its weights into NaN; use bfloat16)")
    device: str = _f("cpu", "torch device: cpu, cuda or cuda:N (checked to exist before anything is loaded)")
    # task
    task: str = _f("passkey", f"task: one of {', '.join(TASKS)}")
    prompt_tokens: int = _f(256, "approximate prompt length in tokens (passkey, multikey, kv, lookup)")
    digits: int = _f(5, "digits of the hidden key (passkey, multikey)")
    num_keys: int = _f(4, "named keys in the prompt, one asked for (multikey) / pairs (kv)")
    hops: int = _f(1, "lookups the answer needs, 1 or 2 (lookup)")
    max_turns: int = _f(3, "model turns per response, each but the last ending in a tool call whose result the "
                           "environment appends (lookup; single-turn tasks have one)")
    format_reward: float = _f(0.0, "reward per well-formed lookup of an existing id, up to hops of them (lookup)")
    data: str = _f("", "jsonl file of {prompt, answer} lines (task jsonl)")
    reward_fn: str = _f("", "python reward 'module:function' called as fn(completion, answer) (task jsonl)")
    # group and sampling
    group_size: int = _f(8, "responses sampled per prompt (G)")
    prompts_per_step: int = _f(1, "prompts (groups) per optimizer step")
    max_new_tokens: int = _f(16, "tokens sampled per response at most")
    temperature: float = _f(1.0, f"sampling temperature, >= {MIN_TEMPERATURE} (below it sampling is greedy in all but "
                                 "name and logits / temperature can overflow; for greedy use top_k = 1)")
    top_p: float = _f(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = _f(0, "top-k sampling (0 = off)")
    # objective
    loss: str = _f("grpo", f"loss: one of {', '.join(LOSSES)}")
    advantage: str = _f("grpo", f"advantage estimator: one of {', '.join(ADVANTAGES)}")
    epsilon_low: float = _f(-1.0, "lower clip (ratio >= 1 - eps), in [0, 1); -1 = the loss's default")
    epsilon_high: float = _f(-1.0, "upper clip (ratio <= 1 + eps; cispo: the weight's cap itself), >= 0; -1 = the "
                                   "loss's default")
    beta: float = _f(0.0, "KL coefficient against a frozen copy of the initial model (k3 estimator)")
    num_iterations: int = _f(1, "optimizer updates per rollout (>1 reuses it with PPO clipping)")
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal (DAPO)")
    # rollout shape (engine/tree/rollout.py): a group of independent responses, or a tree that branches
    rollout: str = _f("group", f"rollout: {' or '.join(ROLLOUTS)} (group: group_size responses per prompt; tree: "
                               "tree_trunks responses that fork into tree_branching continuations, trained with "
                               "backward_tree, every shared token encoded once)")
    tree_trunks: int = _f(2, "rollout tree: responses sampled from the prompt (N)")
    tree_branching: int = _f(2, "rollout tree: continuations per fork (B, >= 2)")
    tree_depth: int = _f(2, "rollout tree: segments on a root-to-leaf path at most (1 = no fork)")
    tree_leaves: int = _f(8, "rollout tree: leaf budget (trajectories per prompt at most, >= tree_trunks); a fork adds "
                             "tree_branching - 1")
    tree_trigger: str = _f("tool_call", f"rollout tree: when a sequence forks: {' or '.join(TREE_TRIGGERS)} "
                                        "(tool_call: once a tool call's result is fed, agent tasks; tokens: every "
                                        "tree_every tokens of a segment)")
    tree_every: int = _f(0, "rollout tree with tree_trigger tokens: fork every N tokens of a segment")
    tree_advantage: str = _f("grpo", f"rollout tree: {' or '.join(TREE_ADVANTAGES)} (grpo: the advantage estimator "
                                     "over every leaf of the prompt's tree; siblings: a leaf's reward minus the mean "
                                     "over the leaves below its parent node, Tree-GRPO's intra-tree comparison)")
    # plan
    plan: str = _f("exact", "gradient plan: exact (the standard GRPO gradient, prompt shared), detach (the paper's: "
                            "no gradient through the prompt), standard (each response with its prompt, one at a time) "
                            "or standard_batched (the whole group in one padded batch)")
    chunk_size: int = _f(2048, "prompt tokens per capture / prompt-backward chunk")
    micro_batch: int = _f(1, "responses replayed at once")
    checkpoint_layers: bool = _f(False, "per-layer activation checkpointing: keep each decoder layer's input only "
                                        "and recompute the layer in the backward (less memory, ~1 more forward)")
    offload_state: bool = _f(False, "detach/exact: keep the prompt state and its gradient in host memory, one "
                                    "layer's part on the device at a time (use with checkpoint_layers)")
    cp: int = _f(1, "context parallelism: consecutive ranks that share one prompt's state, each holding 1/cp of "
                    "its K/V (launch with --nproc a multiple of cp); detach/exact plans, full-attention and "
                    "recurrent layers")
    tp: int = _f(1, "tensor parallelism: consecutive ranks that hold one model split by heads with transformers' "
                    "tp_plan (each rank 1/tp of the K/V and of the attention/MLP weights; launch with --nproc a "
                    "multiple of cp * tp); llama, mistral, qwen2, qwen3, qwen3_moe, gemma3")
    # optimizer
    steps: int = _f(20, "optimizer steps in total")
    lr: float = _f(1e-5, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(0, "linear LR warm-up steps")
    lr_schedule: str = _f("constant", f"after warm-up: {' or '.join(LR_SCHEDULES)}")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    seed: int = _f(0, "seed for data, sampling and presets' init")
    # run
    run_dir: str = _f("runs/latest", "directory for metrics.jsonl, checkpoints and plots")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    resume: bool = _f(False, "continue from the checkpoint in run_dir")
    overwrite: bool = _f(False, "delete the run already in run_dir (its checkpoint, metrics, summary, plot) and "
                                "start over; without it (or --resume) a run_dir holding a run is refused")
    force: bool = _f(False, "with resume: accept settings that change what is trained (task, data, loss, group "
                            "size, lr, seed, ...) or the model's name; refused without it since they silently "
                            "change the run")
    save_weights_only: bool = _f(False, "checkpoints keep the model weights but not the optimizer state (~1/3 of "
                                        "the size with AdamW); a resume then restarts the optimizer")
    stop_after: int = _f(0, "stop with a checkpoint after N steps of this invocation (0 = run to --steps)")
    eval_prompts: int = _f(8, "held-out prompts scored greedily before and after training (0 = skip)")
    tensorboard: bool = _f(False, "also log to TensorBoard under run_dir/tb (needs the tensorboard package)")
    plot: bool = _f(True, "write run_dir/progress.png at the end (needs matplotlib)")
    # supervised warm start (an agent task's gold trajectories, before GRPO; train/warmup.py)
    warm_start_steps: int = _f(0, "steps of the nll loss on gold trajectories the task writes (call, its result "
                                  "masked, answer) before GRPO, on a fresh run (lookup; 0 = none)")
    warm_start_lr: float = _f(1e-4, "AdamW learning rate of the warm start (its own optimizer)")
    warm_start_batch: int = _f(4, "gold trajectories per warm-start step, each its own prompt")
    bias_every: int = _f(0, "detach plan only: every N steps also compute the exact gradient of the step's groups at "
                            "the same weights and log its cosine and relative error to the detach gradient "
                            "(bias_cosine, bias_rel_error in metrics.jsonl); the run itself is unchanged (0 = off)")

    def __post_init__(self) -> None:
        need = _need
        self._check_types(need)
        self._check_choices(need)
        self._check_ranges(need)
        self._check_rollout(need)
        self.backward_options()  # plan, loss and its parameters, and their combinations: the engine's own rules

    def _check_types(self, need: Callable[[bool, str], None]) -> None:
        """Each field's Python type."""
        # Types first (a TrainConfig built in Python skips argparse's and load_toml's conversions), so that every
        # range check below compares numbers, and NaN cannot slip through a comparison that is simply False.
        for f in fields(self):
            kind, value = f.type if isinstance(f.type, str) else f.type.__name__, getattr(self, f.name)
            if kind == "int":
                need(isinstance(value, int) and not isinstance(value, bool),
                     f"{f.name} must be an integer, got {value!r}")
            elif kind == "float":
                need(isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value),
                     f"{f.name} must be a finite number, got {value!r}")
            elif kind == "bool":
                need(isinstance(value, bool), f"{f.name} must be true or false, got {value!r}")
            elif kind == "str":
                need(isinstance(value, str), f"{f.name} must be a string, got {value!r}")

    def _check_choices(self, need: Callable[[bool, str], None]) -> None:
        """The named choices (device, task, plan, loss, advantage, schedule, dtype) and their combinations."""
        _check_device(self.device)
        need(self.task in TASKS, f"task {self.task!r} is unknown{did_you_mean(self.task, TASKS)}: choose one of "
                                 f"{', '.join(TASKS)}")
        # plan and loss are the engine's to check too (backward_options below); here with the closest names
        need(self.plan in PLANS, f"unknown plan {self.plan!r}{did_you_mean(self.plan, PLANS)}: choose one of "
                                 f"{', '.join(PLANS)}")
        need(self.loss in LOSSES, f"unknown loss {self.loss!r}{did_you_mean(self.loss, LOSSES)}: choose one of "
                                  f"{', '.join(LOSSES)}")
        need(self.cp >= 1, f"cp must be >= 1, got {self.cp}")
        need(self.tp >= 1, f"tp must be >= 1, got {self.tp}")
        need(self.cp == 1 or self.plan in ("detach", "exact"),
             f"cp = {self.cp} shards the prompt state, which the {self.plan} plan does not use: --plan detach or exact")
        need(self.advantage in ADVANTAGES, f"advantage {self.advantage!r} is unknown"
             f"{did_you_mean(self.advantage, ADVANTAGES)}: choose one of {', '.join(ADVANTAGES)}")
        # The meter measures the detach plan's bias; exact and standard compute the unbiased gradient themselves.
        need(self.bias_every <= 0 or self.plan == "detach",
             f"bias_every measures the detach plan's gradient against the exact one; the {self.plan} plan computes "
             "the exact gradient itself (no bias to measure): use --plan detach or drop --bias-every")
        need(self.lr_schedule in LR_SCHEDULES, f"lr_schedule must be {' or '.join(LR_SCHEDULES)}, got "
             f"{self.lr_schedule!r}{did_you_mean(self.lr_schedule, LR_SCHEDULES)}")
        need(self.dtype != "float16",
             "dtype float16 is not supported for training: AdamW's eps (1e-8) rounds to 0 in float16 and, without "
             "loss scaling and float32 master weights, the weights become NaN; use --dtype bfloat16 (same memory, "
             "float32's range) or float32")
        need(self.dtype in DTYPES,  # float16 is refused above
             f"dtype {self.dtype!r} is unknown: choose float32, bfloat16 or float64"
             f"{did_you_mean(self.dtype, [d for d in DTYPES if d != 'float16'])}")

    def _check_ranges(self, need: Callable[[bool, str], None]) -> None:
        """The numbers' ranges, and which options the task takes."""
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "num_iterations", "chunk_size",
                     "micro_batch", "steps", "prompt_tokens", "digits", "num_keys", "max_turns"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_prompts", "warmup_steps", "top_k", "stop_after", "bias_every"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        need(self.group_size >= 2 or self.advantage == "mean_centered",
             f"group_size {self.group_size} is too small: GRPO compares responses within a group; use >= 2")
        need(self.hops in (1, 2), f"hops must be 1 or 2, got {self.hops}")
        need(math.isfinite(self.format_reward) and 0 <= self.format_reward <= 1,
             f"format_reward must be in [0, 1], got {self.format_reward}")
        for name in ("lr", "temperature", "top_p", "beta", "weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")
        need(self.lr > 0, "lr must be > 0")
        need(self.temperature >= MIN_TEMPERATURE,
             f"temperature must be >= {MIN_TEMPERATURE}, got {self.temperature}: below it sampling is already greedy "
             "in all but name, and logits / temperature can overflow to inf (1e-45 makes every logit inf); for greedy "
             "sampling use --top-k 1")
        # The clip widths: -1 (exactly) asks for the loss's own default; anything else must be a usable width.
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            need(value == -1 or (math.isfinite(value) and value >= 0),
                 f"{name} must be a finite number >= 0, or -1 for the loss's default; got {value}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        if self.task == "jsonl":
            need(bool(self.data), "task jsonl needs --data FILE.jsonl")
        else:
            need(not self.data and not self.reward_fn, "--data and --reward-fn only apply to --task jsonl")
        need(self.warm_start_steps >= 0, f"warm_start_steps must be >= 0, got {self.warm_start_steps}")
        need(self.warm_start_batch >= 1, f"warm_start_batch must be >= 1, got {self.warm_start_batch}")
        need(math.isfinite(self.warm_start_lr) and self.warm_start_lr > 0,
             f"warm_start_lr must be a finite number > 0, got {self.warm_start_lr}")
        need(self.warm_start_steps == 0 or self.task == "lookup",
             f"warm_start_steps trains on gold trajectories an agent task writes; task {self.task!r} writes none: use "
             "--task lookup or drop --warm-start-steps")

    def _check_rollout(self, need: Callable[[bool, str], None]) -> None:
        """The rollout's shape and what a tree rollout trains with (backward_tree's plans and losses)."""
        need(self.rollout in ROLLOUTS, f"rollout {self.rollout!r} is unknown{did_you_mean(self.rollout, ROLLOUTS)}: "
                                       f"choose one of {', '.join(ROLLOUTS)}")
        need(self.tree_trigger in TREE_TRIGGERS, f"tree_trigger {self.tree_trigger!r} is unknown"
             f"{did_you_mean(self.tree_trigger, TREE_TRIGGERS)}: choose one of {', '.join(TREE_TRIGGERS)}")
        need(self.tree_advantage in TREE_ADVANTAGES, f"tree_advantage {self.tree_advantage!r} is unknown"
             f"{did_you_mean(self.tree_advantage, TREE_ADVANTAGES)}: choose one of {', '.join(TREE_ADVANTAGES)}")
        if self.rollout != "tree":
            return
        for name, low in (("tree_trunks", 1), ("tree_branching", 2), ("tree_depth", 1), ("tree_every", 0)):
            need(getattr(self, name) >= low, f"{name} must be >= {low}, got {getattr(self, name)}")
        need(self.tree_leaves >= self.tree_trunks,
             f"tree_leaves ({self.tree_leaves}) is below tree_trunks ({self.tree_trunks}): every trunk is a leaf "
             "until it forks; raise --tree-leaves or lower --tree-trunks")
        need(self.tree_leaves >= 2 or self.advantage == "mean_centered" or self.tree_advantage == "siblings",
             f"tree_leaves {self.tree_leaves}: GRPO compares the leaves of a tree; use >= 2")
        if self.tree_trigger == "tokens":
            need(self.tree_every >= 1, "--tree-trigger tokens forks every --tree-every tokens: set --tree-every N "
                                       "(N >= 1)")
        else:
            need(self.tree_every == 0, f"--tree-every {self.tree_every} applies to --tree-trigger tokens; "
                                       "tool_call forks at tool calls: drop --tree-every or use --tree-trigger tokens")
            need(self.task == "lookup" or self.tree_depth == 1,
                 f"--tree-trigger tool_call forks at tool calls, which task {self.task!r} has none of: use --task "
                 "lookup, or --tree-trigger tokens --tree-every N")
        need(self.plan in ("exact", "detach", "standard"),
             f"--rollout tree trains with backward_tree, whose plans are exact, detach and standard; got "
             f"{self.plan!r}")
        need(self.cp == 1, "--rollout tree does not run under context parallelism (backward_tree refuses it): drop "
                           "--cp")
        need(self.bias_every == 0, "--bias-every measures groups (backward_group); --rollout tree has none: drop it")

    def loss_config(self) -> LossConfig:
        """The loss this config sets; a clip value of -1 means "the loss's own default"."""
        from longstraw.engine.loss.config import LossConfig

        return LossConfig(self.loss, beta=self.beta, epsilon_low=self.epsilon_low if self.epsilon_low >= 0 else None,
                          epsilon_high=self.epsilon_high if self.epsilon_high >= 0 else None)

    def backward_options(self, plan: str | None = None,
                         context_shards: ContextShards | None = None) -> BackwardOptions:
        """The `backward_group` options of this config (validated there), with another plan if given (the bias
        meter's exact) and the run's context-parallel group."""
        from longstraw.engine.options import BackwardOptions
        from longstraw.plan import plan_named

        return BackwardOptions(plan=plan_named(self.plan if plan is None else plan), loss=self.loss_config(),
                               chunk_size=self.chunk_size, micro_batch=self.micro_batch,
                               checkpoint="layers" if self.checkpoint_layers else "none",
                               offload_state=self.offload_state, context_shards=context_shards)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_device(device: str) -> None:
    """A parseable torch device that exists here, checked before any run directory or model is touched."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is available to this torch "
                             f"({torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: training runs on cpu or cuda devices")


# The TOML file's sections and the fields each holds.
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device"),
    "task": ("task", "prompt_tokens", "digits", "num_keys", "hops", "max_turns", "format_reward", "data", "reward_fn"),
    "rollout": ("group_size", "prompts_per_step", "max_new_tokens", "temperature", "top_p", "top_k",
                "dynamic_sampling", "rollout", "tree_trunks", "tree_branching", "tree_depth", "tree_leaves",
                "tree_trigger", "tree_every", "tree_advantage"),
    "plan": ("plan", "chunk_size", "micro_batch", "checkpoint_layers", "offload_state", "loss", "advantage",
             "epsilon_low", "epsilon_high", "beta", "num_iterations"),
    "optimizer": ("steps", "lr", "weight_decay", "warmup_steps", "lr_schedule", "max_grad_norm", "warm_start_steps",
                  "warm_start_lr", "warm_start_batch"),
    "run": ("seed", "run_dir", "save_every", "resume", "overwrite", "force", "save_weights_only", "stop_after",
            "eval_prompts", "tensorboard", "plot", "bias_every"),
    "parallelism": ("cp", "tp"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}


def _flatten_sections(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The `[section]` tables of a TOML file as one flat dict; ValueError for a key outside its section."""
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            if not isinstance(table, dict) and section not in SECTION_OF:
                raise ValueError(f"{path}: unknown option {section}{did_you_mean(section, SECTION_OF)}")
            if section in SECTION_OF:
                raise ValueError(f"{path}: {section} belongs in [{SECTION_OF[section]}]")
            raise ValueError(f"{path}: unknown section [{section}]{did_you_mean(section, SECTIONS)}; sections: "
                             f"{', '.join(f'[{name}]' for name in SECTIONS)}")
        if not isinstance(table, dict):  # a flat key whose name is also a section's (plan = "exact")
            raise ValueError(f"{path}: {section} belongs in [{SECTION_OF[section]}]")
        for key, value in table.items():
            if key in SECTION_OF and SECTION_OF[key] != section:
                raise ValueError(f"{path}: {key} belongs in [{SECTION_OF[key]}], not [{section}]")
            flat[key] = value
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    """The options of a TOML file's `[section]` tables (SECTIONS), flat and checked against the fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}): TOML files are UTF-8; save it as "
                         "UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its message ends with "(at line N, column M)"
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    data = _flatten_sections(path, data)
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        hints = "".join(did_you_mean(key, known) for key in unknown)
        raise ValueError(f"{path}: unknown option(s) {', '.join(unknown)}{hints}; valid options: "
                         f"{', '.join(sorted(known))}")
    # A destructive option is honoured only when typed for this invocation: a file reused for a later run would
    # otherwise delete that run's directory without anyone asking for it.
    if data.get("overwrite") is True:
        raise ValueError(f"{path}: overwrite = true deletes the run already in run_dir; a file cannot ask for that: "
                         "remove it from the file and pass --overwrite on the command line")
    types = {f.name: (f.type if isinstance(f.type, str) else f.type.__name__) for f in fields(TrainConfig)}
    accepts = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    for key, value in data.items():
        kind = types[key]
        if not isinstance(value, accepts[kind]) or (kind != "bool" and isinstance(value, bool)):
            raise ValueError(f"{path}: {key} must be a {kind}, got {value!r}")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`config` (optional TOML path) plus one `--field-name` per field, defaulting to None (= not given)."""
    parser.add_argument("config", nargs="?", help="TOML file of options; command-line flags override it")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_text = f"{f.metadata.get('help', '')} (default: {default!r})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def values_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options set by the TOML file, then by command-line flags (unset fields are absent: their defaults)."""
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    for f in fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return values


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then command-line flags."""
    return TrainConfig(**values_from_args(args))
