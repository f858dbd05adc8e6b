"""One rank of the context-parallel test: `backward_group` with the prompt state sharded over all ranks.

argv: OUT_PATH [masked]. For every case of CASES (of MASKED_CASES with "masked"), every rank computes the group's
log-probs and gradient with a context-parallel prompt state; each rank saves its results (gradient, log-probs,
prompt-state bytes per case) to OUT_PATH.rank<r>.
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
# (family, plan) with loss masks, run instead of CASES when argv[2] is "masked": full attention with both replay
# plans, and the recurrent hybrid
MASKED_CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3_5_text", "exact")]


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    results = {}
    only_masked = sys.argv[2:] == ["masked"]
    for family, plan, checkpoint in [] if only_masked else CASES:
        model = helpers.tiny_model(family, torch.float32)
        group = helpers.random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32)
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2,
                                context_shards=ContextParallel(), checkpoint=checkpoint)
        results[(family, plan, checkpoint)] = {"grads": helpers.grads(model), "logprobs": result.logprobs,
                                   "state_bytes": result.stats["prompt_state_bytes"]}
    # Loss masks (an agent's observation tokens): masked tokens in the middle of each response.
    for family, plan in MASKED_CASES if only_masked else []:
        model = helpers.tiny_model(family, torch.float32)
        group = helpers.masked(helpers.random_group(PROMPT, RESPONSES, seed=3, dtype=torch.float32))
        result = backward_group(model, group, plan=plan, chunk_size=CHUNK, micro_batch=2,
                                context_shards=ContextParallel())
        results[("masked", family, plan)] = {"grads": helpers.grads(model), "logprobs": result.logprobs}
    torch.save(results, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
