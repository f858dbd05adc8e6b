"""One rank of the context-parallel test: `backward_group` with the prompt state sharded over all ranks.

argv: OUT_PATH. For every case of CASES, every rank computes the group's log-probs and gradient with a
context-parallel prompt state; each rank saves its results (gradient, log-probs, prompt-state bytes per case)
to OUT_PATH.rank<r>.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw import backward_group
from longstraw.distributed.context import ContextParallel

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

PROMPT, RESPONSES, CHUNK = 61, [5, 1, 9], 8  # 60 encoded positions in 8 chunks: not divisible by 3
# (family, plan, checkpoint): full attention; a hybrid with recurrent layers; both with per-layer checkpointing
CASES = [("llama", "exact", "none"), ("llama", "detach", "none"), ("qwen3_5_text", "exact", "none"),
         ("llama", "exact", "layers"), ("qwen3_5_text", "exact", "layers")]  # full attention; hybrid recurrent


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    results = {}
    for family, plan, checkpoint in CASES:
        model = helpers.tiny_model(family, torch.float32)
        group = helpers.random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32)
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2,
                                context_shards=ContextParallel(), checkpoint=checkpoint)
        results[(family, plan, checkpoint)] = {"grads": helpers.grads(model), "logprobs": result.logprobs,
                                   "state_bytes": result.stats["prompt_state_bytes"]}
    # Loss masks (an agent's observation tokens): the llama exact case again with masked tokens.
    model = helpers.tiny_model("llama", torch.float32)
    group = helpers.masked(helpers.random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32))
    result = backward_group(model, group, plan="exact", chunk_size=CHUNK, micro_batch=2,
                            context_shards=ContextParallel())
    results["masked"] = {"grads": helpers.grads(model), "logprobs": result.logprobs,
                         "state_bytes": result.stats["prompt_state_bytes"]}
    torch.save(results, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
