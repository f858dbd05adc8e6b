"""One process of the multi-turn rollout peak test: a G-sequence rollout with an environment from a long prompt.

argv: G. Prints one JSON line: the rollout's peak above the process's memory before it (bytes, VmHWM), the prompt
state's size, and the rollout's tool calls. Run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), as the
benches run, so that freed blocks go back to the system and the peak measures what is live.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from longstraw.engine.sampling import SamplingConfig, sample_group
from longstraw.peak import PeakMemory

PROMPT = 8192  # the prompt state: 8191 positions x 2 layers x (K, V) x 256 x 4 bytes = 32 MiB
CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=PROMPT + 256)


def environment(i: int, response: torch.Tensor) -> torch.Tensor | None:
    """16 observation tokens per call, derived from the sequence and the response's length; the third call ends."""
    if response.numel() > 40:
        return None
    return torch.tensor([(7 * i + 3 * response.numel() + t) % 512 for t in range(16)])


def main() -> None:
    group_size = int(sys.argv[1])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG).eval()
    prompt = torch.randint(0, 512, (PROMPT,), generator=torch.Generator().manual_seed(1))
    free = sample_group(model, prompt, 4, SamplingConfig(max_new_tokens=16, top_k=3), seed=2, chunk_size=2048)
    call = int(torch.cat(free.responses).bincount().argmax())  # a token the model writes often: the call's end
    cfg = SamplingConfig(max_new_tokens=64, top_k=3, call_end=(call,), max_turns=3)
    meter = PeakMemory("cpu")
    meter.start()  # the prompt state (captured by the first rollout, reused) is already in memory
    out = sample_group(model, prompt, group_size, cfg, seed=1, state=free.state, environment=environment)
    print(json.dumps({"peak_bytes": meter.peak_bytes(), "reset_ok": meter.reset_ok,
                      "state_bytes": out.state.nbytes(), "tool_calls": sum(out.tool_calls or [])}))


if __name__ == "__main__":
    main()
