"""Child of test_trl.py's memory test: one GRPO step of b1-llama through a TRL trainer class, in a fresh process
run in a scratch directory (the trainer's output_dir is relative); prints the peak RSS above the start of
`compute_loss` (the loss and its backward; generation is a fixed function, so it costs nothing) as JSON.
argv: trainer (longstraw | trl), G, prompt tokens, completion tokens."""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from longstraw import load_model
from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
from longstraw.models.tokenizer import byte_tokenizer_hf
from longstraw.peak import PeakMemory


def main() -> None:
    which, g, prompt_tokens, completion_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    trainer_cls, config_cls = ((LongStrawGRPOTrainer, LongStrawGRPOConfig) if which == "longstraw"
                               else (GRPOTrainer, GRPOConfig))
    args = config_cls(output_dir="trl-peak-out", per_device_train_batch_size=g, num_generations=g,
                      max_completion_length=completion_tokens, max_steps=1, bf16=False, report_to="none",
                      save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, logging_strategy="no")
    trainer = trainer_cls(load_model("b1-llama"), reward_funcs=lambda completions, **kw: [float(ord(c[0]) % 5)
                                                                                          for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["x" * prompt_tokens] * 2}),
                          processing_class=byte_tokenizer_hf())

    def completions(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [[97 + (k * 7 + t) % 26 for t in range(completion_tokens)] for k in range(len(prompt_ids))], None

    trainer._generate_single_turn = completions
    peaks = []
    compute_loss = trainer.compute_loss

    def measured(*a, **kw):
        meter = PeakMemory()
        meter.start()
        out = compute_loss(*a, **kw)
        if out.requires_grad and out.grad_fn is not None:  # TRL's: its backward is part of the step
            out.backward(retain_graph=False)
            out = out.detach().requires_grad_(True)
        peaks.append(meter.peak_bytes())
        return out

    trainer.compute_loss = measured
    trainer.train()
    print(json.dumps({"trainer": which, "G": g, "peak_mib": max(peaks) / 2**20}))


if __name__ == "__main__":
    main()
