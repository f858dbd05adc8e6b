"""TRL's GRPOTrainer with LongStraw's backward under FSDP2, optionally with context parallelism: two optimizer steps.

    accelerate launch --num_processes 8 examples/trl_fsdp2.py            # 8 GPUs, parameters sharded 8 ways
    accelerate launch --num_processes 8 examples/trl_fsdp2.py --cp 2     # and every prompt's state split over 2
    accelerate launch --num_processes 8 examples/trl_fsdp2.py --cp 8 --gather layer   # a layer gathered at a time
    torchrun --nproc_per_node 8 examples/trl_fsdp2.py --cp 2             # the same without accelerate's launcher

FSDP2 is switched on by the config (`fsdp=True`: TrainingArguments' FSDP, version 2, full shard), so no accelerate
config file is needed; examples/accelerate/fsdp2.yaml is the config-file way. Each process generates its own
prompts' groups. With `--cp C`, blocks of C processes exchange their groups and backpropagate each of them together,
each process holding 1/C of every prompt's K/V. `--gather layer` (needs `--cp` equal to the number of processes)
gathers one decoder layer at a time instead of every parameter once per micro-batch. accelerate runs FSDP on
accelerators only: on CPU it falls back to plain data parallelism (the tests run this script on CPU through a shim
that enables accelerate's FSDP path there). The model is the random-init `tiny-qwen3` preset with a byte tokenizer,
so it runs anywhere; for real work pass a model id or directory and its tokenizer (docs/trl.md).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset

from longstraw import load_model
from longstraw.distributed import end_process_group
from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
from longstraw.models.tokenizer import byte_tokenizer_hf


def reward_vowels(completions, **kwargs):
    return [float(sum(c.count(v) for v in "aeiou")) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=1, help="processes per context-parallel block (default 1: none)")
    parser.add_argument("--gather", choices=("all", "layer"), default="all",
                        help="FSDP2 gathering: every parameter once per micro-batch (default), or a layer at a time")
    options = parser.parse_args()
    cp = options.cp
    on_cpu = not torch.cuda.is_available()
    model = load_model("tiny-qwen3", dtype="float32")
    prompts = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(16)]
    args = LongStrawGRPOConfig(
        output_dir=os.environ.get("OUTPUT_DIR", "runs/trl-fsdp2"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, max_steps=2, learning_rate=1e-4, bf16=not on_cpu, use_cpu=on_cpu,
        report_to="none", save_strategy="no", logging_steps=1, fsdp=True, fsdp_config={"version": 2},
        longstraw_plan="exact", longstraw_chunk_size=128, longstraw_cp=cp, longstraw_fsdp_gather=options.gather,
    )
    trainer = LongStrawGRPOTrainer(model, reward_funcs=reward_vowels, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                                   processing_class=byte_tokenizer_hf())
    trainer.train()
    if trainer.accelerator.is_main_process:
        kind = trainer.accelerator.distributed_type.value
        print(f"trained {trainer.state.global_step} steps on {trainer.accelerator.num_processes} processes ({kind}, "
              f"context-parallel blocks of {cp}, FSDP gathering {options.gather})")


if __name__ == "__main__":
    main()
    end_process_group()  # after the trainer is gone: gloo's threads stop cleanly instead of aborting at exit
