"""TRL's GRPOTrainer with LongStraw's backward on several processes (data parallelism), two optimizer steps.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/trl_ddp.py    # CPU, gloo
    accelerate launch --num_processes 8 examples/trl_ddp.py                 # 8 GPUs, one process each
    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml examples/trl_ddp.py  # DeepSpeed ZeRO-3

Each process generates and backpropagates its own prompts' groups; LongStraw averages the gradients over the
processes once per optimizer step, as DDP does (under DeepSpeed, DeepSpeed reduces them). The model here is the
random-init `tiny-qwen3` preset with a byte tokenizer, so it runs anywhere; for real work pass a model id or directory
and its tokenizer (docs/trl.md).
"""

from __future__ import annotations

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
    # On CPU processes without DeepSpeed, accelerate's MULTI_CPU (gloo); DeepSpeed needs use_cpu off.
    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    model = load_model("tiny-qwen3")
    prompts = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(16)]
    args = LongStrawGRPOConfig(
        output_dir=os.environ.get("OUTPUT_DIR", "runs/trl-ddp"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, max_steps=2, learning_rate=1e-4, bf16=not on_cpu, use_cpu=on_cpu and not deepspeed,
        report_to="none", save_strategy="no", logging_steps=1,
        longstraw_plan="exact", longstraw_chunk_size=256,
    )
    trainer = LongStrawGRPOTrainer(model, reward_funcs=reward_vowels, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                                   processing_class=byte_tokenizer_hf())
    trainer.train()
    if trainer.accelerator.is_main_process:
        kind = trainer.accelerator.distributed_type.value
        print(f"trained {trainer.state.global_step} steps on {trainer.accelerator.num_processes} processes ({kind})")


if __name__ == "__main__":
    main()
    end_process_group()  # after the trainer is gone: gloo's threads stop cleanly instead of aborting at exit
