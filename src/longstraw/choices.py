"""The names the command line offers (plans, losses, advantage estimators, checkpointing, tasks, dtypes, model
presets), `did_you_mean` for a mistyped one and `int_at_least` for a count, in a module that imports nothing at load:
`longstraw --help` and `--version` build every parser from these without importing torch (~5 s on a small CPU
machine). The modules that implement them re-export them (`longstraw.PLANS`, `longstraw.planner.PLANS`, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longstraw.plan import PLANS as _PLAN_VALUES  # the Plan values and their properties
from longstraw.plan import PLANS_BASELINE_FIRST as _BASELINE_FIRST

if TYPE_CHECKING:
    from collections.abc import Iterable

PLANS = tuple(_PLAN_VALUES)  # the plans' names: `backward_group(plan=...)`, `--plan`, `--plans`
# How tables, plots and the planner's document list them: the baseline (standard_batched) first.
PLANS_BASELINE_FIRST = tuple(plan.name for plan in _BASELINE_FIRST)
LOSSES = ("grpo", "dr_grpo", "dapo", "gspo", "luspo", "cispo", "sapo", "vespo")
ADVANTAGES = ("grpo", "mean_centered", "rloo")
CHECKPOINT_CHOICES = ("none", "layers")
TASKS = ("passkey", "multikey", "kv", "jsonl", "lookup")  # `longstraw.tasks.make_task` builds them

# The lowest sampling and scoring temperature (`--temperature`, `SamplingConfig`, `BackwardOptions`). The sampler
# divides the logits by the temperature in the model's dtype (float32's range for float32 and bfloat16 models). At
# 1e-3 a logit keeps 35 orders of magnitude of headroom below float32's largest value (3.4e38), and a logit gap of 0.01
# already weighs e^10 : 1, so a lower temperature changes nothing but the risk: a subnormal such as 1e-45 turns every
# logit into inf and the probabilities into NaN.
MIN_TEMPERATURE = 1e-3

# Parameter dtypes under torch's names and their short spellings, with bytes per element (the planner's sizes;
# `models.load_model` takes the torch dtype of the name, via DTYPE_ALIASES for a short spelling).
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float64": 8, "fp64": 8, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
DTYPES = tuple(name for name in DTYPE_BYTES if name not in DTYPE_ALIASES)  # torch's names: float32, float64, ...

# The model presets (`longstraw.models.presets.PRESETS`, random-init configs) and the real models shipped in a PyPI
# package (`longstraw.models.gguf_files.PACKAGED_GGUF`), by name, for help texts that must not import transformers;
# tests/test_cli.py checks that they match those mappings.
PRESET_NAMES = ("tiny-llama", "tiny-qwen3", "tiny-mamba2", "b1-llama", "b1-qwen3", "b1-qwen3-next", "b1-deepseek-v3",
                "b1-mamba2", "gpu-llama-1b", "tiny-llama-long", "deep-smollm2")
PACKAGED_MODELS = ("smollm2-135m",)
LR_SCHEDULES = ("constant", "cosine")


def did_you_mean(name: object, known: Iterable[object], what: str = "", n: int = 3) -> str:
    """' (did you mean X?)' naming the entries of `known` closest to a mistyped `name` (difflib's ratio >= 0.6, at
    most `n`), or "" when none is close. `what`: said first (' (--grop-size: did you mean --group-size?)')."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=n, cutoff=0.6)
    if not close:
        return ""
    names = close[0] if len(close) == 1 else ", ".join(close[:-1]) + " or " + close[-1]
    return f" ({what + ': ' if what else ''}did you mean {names}?)"


def int_at_least(name: str, value: object, low: int, what: str = "") -> int:
    """`value` if it is an int (not a bool) >= low, else a ValueError naming `name` (and `what` it counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    return value
