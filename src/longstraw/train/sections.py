"""The seven sections of `TrainConfig`, one dataclass per `[section]` of a train TOML file: typed fields with help
text, each field a TOML key and a `--field-name` flag (names unique across sections, so flags and flat options need no
section). Each section checks the rules about its own fields when built; `TrainConfig` checks those across sections."""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
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
from longstraw.plan import Plan, plan_named

if TYPE_CHECKING:
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.options import BackwardOptions
    from longstraw.engine.state.sharding import ContextShards

ROLLOUTS = ("group", "tree")
TREE_TRIGGERS = ("tool_call", "tokens")  # engine.tree.rollout.TRIGGERS, named here without importing torch
TREE_ADVANTAGES = ("grpo", "siblings")  # engine.tree.rollout.TREE_ADVANTAGES


def _f(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's name
    return field(default=default, metadata={"help": help})


def need(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond holds."""
    if not cond:
        raise ValueError(message)


def field_kind(f: Field[Any]) -> str:
    """A field's type as given on the command line and in TOML: int, float, bool or str (a Plan by its name)."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return "str" if kind == "Plan" else kind


def of_kind(kind: str, value: Any) -> bool:
    """Whether `value` is of `field_kind` `kind` (an int is a float too; a bool is no number)."""
    accepts = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    return isinstance(value, accepts[kind]) and (kind == "bool" or not isinstance(value, bool))


def _check_types(section: Any) -> None:
    """Each field's Python type, before any range check: a section built in Python skips argparse's and
    load_toml's conversions, and NaN must not slip through a comparison that is simply False."""
    words = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}
    for f in fields(section):
        kind, value = field_kind(f), getattr(section, f.name)
        if not isinstance(value, Plan):
            need(of_kind(kind, value) and not (kind == "float" and math.isnan(value)),
                 f"{f.name} must be {words[kind]}, got {value!r}")


def _at_least(section: Any, low: int, *names: str) -> None:
    for name in names:
        need(getattr(section, name) >= low, f"{name} must be >= {low}, got {getattr(section, name)}")


def _finite(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        need(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    need(value in valid, f"{name} {value!r} is unknown{did_you_mean(value, valid)}: choose one of {', '.join(valid)}")


@dataclass
class ModelSection:
    """[model]: the model trained, its parameters' dtype and the device."""

    model: str = _f("tiny-qwen3", f"a preset (random weights: {', '.join(PRESET_NAMES)}), a packaged real model "
                                  f"({', '.join(PACKAGED_MODELS)}), a Hugging Face id (owner/name), a local directory "
                                  "or a .gguf file")
    dtype: str = _f("float32", "parameter dtype: float32, bfloat16, float64 (float16 is refused: AdamW without "
                               "loss scaling or float32 master weights turns its weights into NaN; use bfloat16)")
    device: str = _f("cpu", "torch device: cpu, cuda or cuda:N (checked to exist before anything is loaded)")

    def __post_init__(self) -> None:
        _check_types(self)
        import torch  # the device must parse and exist here, before any run directory or model is touched

        try:
            dev = torch.device(self.device)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"device {self.device!r} is not a torch device: use cpu, cuda or cuda:N") from None
        if dev.type == "cuda":
            need(torch.cuda.is_available(), f"device {self.device!r}: no CUDA GPU is available to this torch "
                                            f"({torch.__version__}); use --device cpu")
            need(dev.index is None or dev.index < torch.cuda.device_count(),
                 f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        need(dev.type in ("cpu", "cuda"), f"device {self.device!r}: training runs on cpu or cuda devices")
        need(self.dtype != "float16",
             "dtype float16 is not supported for training: AdamW's eps (1e-8) rounds to 0 in float16 and, without "
             "loss scaling and float32 master weights, the weights become NaN; use --dtype bfloat16 (same memory, "
             "float32's range) or float32")
        need(self.dtype in DTYPES,  # float16 is refused above
             f"dtype {self.dtype!r} is unknown: choose float32, bfloat16 or float64"
             f"{did_you_mean(self.dtype, [d for d in DTYPES if d != 'float16'])}")


@dataclass
class TaskSection:
    """[task]: the task that writes prompts and scores responses, and its shape."""

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

    def __post_init__(self) -> None:
        _check_types(self)
        _choice("task", self.task, TASKS)
        _at_least(self, 1, "prompt_tokens", "digits", "num_keys", "max_turns")
        need(self.hops in (1, 2), f"hops must be 1 or 2, got {self.hops}")
        need(math.isfinite(self.format_reward) and 0 <= self.format_reward <= 1,
             f"format_reward must be in [0, 1], got {self.format_reward}")
        if self.task == "lookup":  # each hop's call is a turn, and the answer one more
            need(self.max_turns > self.hops,
                 f"--max-turns {self.max_turns} leaves no turn for the answer: lookup with --hops {self.hops} takes "
                 f"{self.hops} tool-call turn(s) and an answer turn, so no rollout could reach the reward; use "
                 f"--max-turns {self.hops + 1} or more")
        if self.task == "jsonl":
            need(bool(self.data), "task jsonl needs --data FILE.jsonl")
        else:
            need(not self.data and not self.reward_fn, "--data and --reward-fn only apply to --task jsonl")


@dataclass
class RolloutSection:
    """[rollout]: what a prompt samples, independent responses or a branching tree (engine/tree/rollout.py), and how."""

    group_size: int = _f(8, "responses sampled per prompt (G)")
    prompts_per_step: int = _f(1, "prompts (groups) per optimizer step")
    max_new_tokens: int = _f(16, "tokens sampled per response at most")
    temperature: float = _f(1.0, f"sampling temperature, >= {MIN_TEMPERATURE} (below it sampling is greedy in all but "
                                 "name and logits / temperature can overflow; for greedy use top_k = 1)")
    top_p: float = _f(1.0, "nucleus sampling mass (1.0 = off)")
    top_k: int = _f(0, "top-k sampling (0 = off)")
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal (DAPO)")
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

    def __post_init__(self) -> None:
        _check_types(self)
        _at_least(self, 1, "group_size", "prompts_per_step", "max_new_tokens")
        _at_least(self, 0, "top_k")
        _finite(self, "temperature", "top_p")
        need(self.temperature >= MIN_TEMPERATURE,
             f"temperature must be >= {MIN_TEMPERATURE}, got {self.temperature}: below it sampling is already greedy "
             "in all but name, and logits / temperature can overflow to inf (1e-45 makes every logit inf); for greedy "
             "sampling use --top-k 1")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _choice("rollout", self.rollout, ROLLOUTS)
        _choice("tree_trigger", self.tree_trigger, TREE_TRIGGERS)
        _choice("tree_advantage", self.tree_advantage, TREE_ADVANTAGES)
        if self.rollout != "tree":  # a tree option on a group rollout would be ignored: say so instead
            given = [f"--{f.name.replace('_', '-')} {getattr(self, f.name)}" for f in fields(self)
                     if f.name.startswith("tree_") and getattr(self, f.name) != f.default]
            need(not given, f"{', '.join(given)}: tree options apply to --rollout tree only, and this run samples "
                            f"{self.rollout}s; add --rollout tree or drop {'them' if len(given) > 1 else 'it'}")
            return
        for name, low in (("tree_trunks", 1), ("tree_branching", 2), ("tree_depth", 1), ("tree_every", 0)):
            _at_least(self, low, name)
        need(self.tree_leaves >= self.tree_trunks,
             f"tree_leaves ({self.tree_leaves}) is below tree_trunks ({self.tree_trunks}): every trunk is a leaf "
             "until it forks; raise --tree-leaves or lower --tree-trunks")
        if self.tree_trigger == "tokens":
            need(self.tree_every >= 1, "--tree-trigger tokens forks every --tree-every tokens: set --tree-every N "
                                       "(N >= 1)")
        else:
            need(self.tree_every == 0, f"--tree-every {self.tree_every} applies to --tree-trigger tokens; "
                                       "tool_call forks at tool calls: drop --tree-every or use --tree-trigger tokens")


@dataclass
class PlanSection:
    """[plan]: how each group's gradient is computed: the plan (a `Plan`, given by name), its memory options, the
    loss and its parameters, the advantage estimator. Everything `backward_options` hands the engine."""

    plan: Plan = _f("exact", "gradient plan: exact (the standard GRPO gradient, prompt shared), detach (the paper's: "
                             "no gradient through the prompt), standard (each response with its prompt, one at a "
                             "time) or standard_batched (the whole group in one padded batch)")
    chunk_size: int = _f(2048, "prompt tokens per capture / prompt-backward chunk")
    micro_batch: int = _f(1, "responses replayed at once")
    checkpoint_layers: bool = _f(False, "per-layer activation checkpointing: keep each decoder layer's input only "
                                        "and recompute the layer in the backward (less memory, ~1 more forward)")
    offload_state: bool = _f(False, "detach/exact: keep the prompt state and its gradient in host memory, one "
                                    "layer's part on the device at a time (use with checkpoint_layers)")
    loss: str = _f("grpo", f"loss: one of {', '.join(LOSSES)}")
    advantage: str = _f("grpo", f"advantage estimator: one of {', '.join(ADVANTAGES)}")
    epsilon_low: float = _f(-1.0, "lower clip (ratio >= 1 - eps), in [0, 1); -1 = the loss's default")
    epsilon_high: float = _f(-1.0, "upper clip (ratio <= 1 + eps; cispo: the weight's cap itself), >= 0; -1 = the "
                                   "loss's default")
    beta: float = _f(0.0, "KL coefficient against a frozen copy of the initial model (k3 estimator)")
    num_iterations: int = _f(1, "optimizer updates per rollout (>1 reuses it with PPO clipping)")

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):  # the name a TOML file or a flag gives
            need(isinstance(self.plan, str), f"plan must be a string, got {self.plan!r}")
            # plan and loss are the engine's to check too (backward_options below); here with the closest names
            need(self.plan in PLANS, f"unknown plan {self.plan!r}{did_you_mean(self.plan, PLANS)}: choose one of "
                                     f"{', '.join(PLANS)}")
            self.plan = plan_named(self.plan)
        _check_types(self)
        need(self.loss in LOSSES, f"unknown loss {self.loss!r}{did_you_mean(self.loss, LOSSES)}: choose one of "
                                  f"{', '.join(LOSSES)}")
        _choice("advantage", self.advantage, ADVANTAGES)
        _at_least(self, 1, "chunk_size", "micro_batch", "num_iterations")
        _finite(self, "beta")
        # The clip widths: -1 (exactly) asks for the loss's own default; anything else must be a usable width.
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            need(value == -1 or (math.isfinite(value) and value >= 0),
                 f"{name} must be a finite number >= 0, or -1 for the loss's default; got {value}")
        self.backward_options()  # plan, loss and its parameters, and their combinations: the engine's own rules

    def loss_config(self) -> LossConfig:
        """The loss this section sets; a clip value of -1 means "the loss's own default"."""
        from longstraw.engine.loss.config import LossConfig

        return LossConfig(self.loss, beta=self.beta, epsilon_low=self.epsilon_low if self.epsilon_low >= 0 else None,
                          epsilon_high=self.epsilon_high if self.epsilon_high >= 0 else None)

    def backward_options(self, plan: Plan | None = None,
                         context_shards: ContextShards | None = None) -> BackwardOptions:
        """The `backward_group` options of this section (validated there), with another plan if given (the bias
        meter's exact) and the run's context-parallel group."""
        from longstraw.engine.options import BackwardOptions

        return BackwardOptions(plan=self.plan if plan is None else plan, loss=self.loss_config(),
                               chunk_size=self.chunk_size, micro_batch=self.micro_batch,
                               checkpoint="layers" if self.checkpoint_layers else "none",
                               offload_state=self.offload_state, context_shards=context_shards)


@dataclass
class OptimizerSection:
    """[optimizer]: AdamW, its schedule and the number of steps; the supervised warm start's own optimizer (an
    agent task's gold trajectories before GRPO, train/warmup.py)."""

    steps: int = _f(20, "optimizer steps in total")
    lr: float = _f(1e-5, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(0, "linear LR warm-up steps")
    lr_schedule: str = _f("constant", f"after warm-up: {' or '.join(LR_SCHEDULES)}")
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    warm_start_steps: int = _f(0, "steps of the nll loss on gold trajectories the task writes (call, its result "
                                  "masked, answer) before GRPO, on a fresh run (lookup; 0 = none)")
    warm_start_lr: float = _f(1e-4, "AdamW learning rate of the warm start (its own optimizer)")
    warm_start_batch: int = _f(4, "gold trajectories per warm-start step, each its own prompt")

    def __post_init__(self) -> None:
        _check_types(self)
        _at_least(self, 1, "steps", "warm_start_batch")
        _at_least(self, 0, "warmup_steps", "warm_start_steps")
        _finite(self, "lr", "weight_decay", "max_grad_norm")
        need(self.lr > 0, "lr must be > 0")
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        need(math.isfinite(self.warm_start_lr) and self.warm_start_lr > 0,
             f"warm_start_lr must be a finite number > 0, got {self.warm_start_lr}")


@dataclass
class RunSection:
    """[run]: the seed, the run directory and its checkpoints, evaluation, logging, and the bias meter."""

    seed: int = _f(0, "seed for data, sampling and presets' init")
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
    bias_every: int = _f(0, "detach plan only: every N steps also compute the exact gradient of the step's groups at "
                            "the same weights and log its cosine and relative error to the detach gradient "
                            "(bias_cosine, bias_rel_error in metrics.jsonl); the run itself is unchanged (0 = off)")

    def __post_init__(self) -> None:
        _check_types(self)
        need(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        _at_least(self, 0, "save_every", "stop_after", "eval_prompts", "bias_every")


@dataclass
class ParallelismSection:
    """[parallelism]: how many ranks share one prompt's state (cp) and one model's weights (tp)."""

    cp: int = _f(1, "context parallelism: consecutive ranks that share one prompt's state, each holding 1/cp of "
                    "its K/V (launch with --nproc a multiple of cp); detach/exact plans, full-attention and "
                    "recurrent layers")
    tp: int = _f(1, "tensor parallelism: consecutive ranks that hold one model split by heads with transformers' "
                    "tp_plan (each rank 1/tp of the K/V and of the attention/MLP weights; launch with --nproc a "
                    "multiple of cp * tp); llama, mistral, qwen2, qwen3, qwen3_moe, gemma3")

    def __post_init__(self) -> None:
        _check_types(self)
        _at_least(self, 1, "cp", "tp")
