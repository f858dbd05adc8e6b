"""One rank of the context-parallel environment test: multi-turn rollouts whose prompt state is sharded over all ranks.

argv: OUT_PATH. Cases, in order, every rank running each: "same" (one deterministic environment: every rank gets the
same rollout), "differ" (the observation's ids depend on the rank), "ended" (the episode ends on rank 1 only),
"raised" (the environment raises on rank 1 only). Each rank saves {case: the rollout's responses, or the error's
type and message} to OUT_PATH.rank<r>. A short process-group timeout bounds a hang.
"""

import datetime
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw.distributed.context import ContextParallel
from longstraw.engine.sampling import SamplingConfig, sample_group

_spec = importlib.util.spec_from_file_location("tests_helpers", Path(__file__).parent.parent / "helpers.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    cp = ContextParallel()
    model = helpers.tiny_model("llama", torch.float32)
    prompt = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(4))  # 32 positions in 4 chunks
    call = int(sample_group(model, prompt, 1, SamplingConfig(max_new_tokens=1, top_k=1), chunk_size=8,
                            context_shards=cp).responses[0][0])
    cfg = SamplingConfig(max_new_tokens=12, top_k=1, call_end=(call,), max_turns=3)

    def environment(case: str):
        def observe(i: int, response: torch.Tensor) -> torch.Tensor | None:
            if case == "ended" and rank == 1:
                return None
            if case == "raised" and rank == 1:
                raise KeyError("no record on this rank")
            return torch.tensor([5 + i, 6 + (rank if case == "differ" else 0)])

        return observe

    results = {}
    for case in ("same", "differ", "ended", "raised"):
        try:
            out = sample_group(model, prompt, 3, cfg, seed=1, chunk_size=8, context_shards=cp,
                               environment=environment(case))
            results[case] = {"responses": out.responses, "tool_calls": out.tool_calls}
        except Exception as err:
            results[case] = {"error": type(err).__name__, "message": str(err)}
    torch.save(results, f"{out_path}.rank{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
