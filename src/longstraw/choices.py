"""The names the command line offers (plans, losses, advantage estimators, checkpointing, tasks, dtypes), in a
module that imports nothing: `longstraw --help` and `--version` build every parser from these without importing
torch (~5 s on a small CPU machine). The modules that implement them re-export them (`longstraw.PLANS`,
`longstraw.planner.PLANS`, ...)."""

from __future__ import annotations

PLANS = ("standard", "standard_batched", "detach", "exact")  # `backward_group(plan=...)`, `--plan`, `--plans`
# How tables, plots and the planner's document list them: the baseline the others are measured against
# (standard_batched, the whole group in one padded batch as an unmodified trainer runs it) first.
PLANS_BASELINE_FIRST = ("standard_batched", *(plan for plan in PLANS if plan != "standard_batched"))
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
