"""One rank of the tree context-parallel test: `backward_tree` with the root's (and every node's) chunks split over
all ranks.

argv: OUT_PATH. For every (family, plan) of CASES, every rank computes the agent tree's gradient and log-probs in
float64 with a context-parallel state and saves them, with its largest path state, to OUT_PATH.rank<r>.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw import backward_tree
from longstraw.distributed.context import ContextParallel

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

CHUNK = 4  # the 17-token root: 16 encoded positions in 4 chunks; the 14-token turn node in 4
CASES = [("llama", "exact"), ("llama", "detach"), ("qwen3_5_text", "exact")]  # full attention; a recurrent hybrid


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    results = {}
    for family, plan in CASES:
        model = helpers.tiny_model(family)
        result = backward_tree(model, helpers.agent_tree(), plan=plan, chunk_size=CHUNK, micro_batch=2,
                               context_shards=ContextParallel())
        results[(family, plan)] = {"grads": helpers.grads(model), "logprobs": result.logprobs,
                                   "state_bytes": result.stats["peak_path_state_bytes"]}
    torch.save(results, f"{out_path}.rank{dist.get_rank()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
