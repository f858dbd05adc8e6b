"""The names the command line offers (plans, losses, advantage estimators, checkpointing, tasks), in a module that
imports nothing: `longstraw --help` and `--version` build every parser from these without importing torch
(~5 s on a small CPU machine). The modules that implement them re-export them (`longstraw.api.MODES`, ...).
"""

from __future__ import annotations

MODES = ("standard", "standard_batched", "detach", "exact")
LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
ADVANTAGES = ("grpo", "mean_centered", "rloo")
CHECKPOINT_CHOICES = ("none", "layers")
TASKS = ("passkey", "multikey", "kv", "jsonl")  # `longstraw.tasks.make_task` builds them
