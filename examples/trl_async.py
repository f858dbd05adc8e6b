"""TRL's asynchronous GRPO trainer with LongStraw's tree: the switch is the import.

    from longstraw.integrations.trl_async import LongStrawAsyncGRPOConfig, LongStrawAsyncGRPOTrainer
    # in place of: from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    python examples/trl_async.py --model Qwen/Qwen3-0.6B --vllm   # TRL's rollout worker; `trl vllm-serve` running
    python examples/trl_async.py --steps 2                        # offline, on the CPU: tiny-qwen3 (random init)

With `--vllm` everything around the loss is TRL's: its rollout worker streams scored samples from the vLLM server,
weights sync to the server after each step. Offline (no server), `GenerateWorker` stands in for the worker through
TRL's documented interface (`rollout_worker`, `weight_transfer`): a thread samples G completions per prompt from a copy
of the policy with transformers' generate, scores them, and queues them with their group-normalised advantages and
the sampler's log-probs; each weight sync loads the trained weights into the copy, and samples older than
`max_staleness` versions are dropped by TRL. Each micro-batch's samples (one shared system prompt, G completions per
prompt) run as one LongStraw prefix tree. docs/trl.md ("TRL's asynchronous trainer").
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from longstraw import load_model
from longstraw.integrations.trl_async import LongStrawAsyncGRPOConfig, LongStrawAsyncGRPOTrainer
from longstraw.models.presets import PRESETS
from longstraw.models.tokenizer import byte_tokenizer_hf, load_tokenizer

SYSTEM = "You answer with one word. Words with many vowels are best. "
PROMPTS = [f"Name a thing that is {colour}." for colour in ("red", "green", "blue", "yellow", "white", "black")]


def reward(text: str) -> float:
    """Vowels per character of the completion: a task any model can move on."""
    return sum(c in "aeiou" for c in text.lower()) / max(len(text), 1)


class GenerateWorker:
    """TRL's rollout worker and weight transfer interfaces in one object, offline (module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, group: int, max_tokens: int, temperature: float):
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=64)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model, self.tokenizer, self.group = model.eval(), tokenizer, group
        self.max_tokens, self.temperature = max_tokens, temperature
        self.version, self.lock, self.stopped = 0, threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="generate-worker", daemon=True)

    # RolloutWorkerProtocol
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ends the thread after its current group (joined: no generate left running at exit)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()

    def update_model_version(self, model_version: int) -> None:
        self.version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the generate worker stopped")

    # WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.lock.acquire()

    def send_weights(self, iterator: Any) -> None:
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in iterator:
                own[name].copy_(tensor)

    def resume(self) -> None:
        self.lock.release()

    def destroy(self) -> None:
        self.stop()

    def _run(self) -> None:
        group_id = 0
        while not self.stopped.is_set():
            prompt = SYSTEM + PROMPTS[group_id % len(PROMPTS)]
            ids = torch.tensor([self.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            with self.lock, torch.no_grad():
                version = self.version
                out = self.model.generate(ids.expand(self.group, -1), do_sample=True, temperature=self.temperature,
                                          max_new_tokens=self.max_tokens, top_k=0, top_p=1.0,
                                          pad_token_id=self.tokenizer.pad_token_id)
                logits = self.model(out).logits[:, :-1].float() / self.temperature
                logp = torch.log_softmax(logits, -1).gather(-1, out[:, 1:, None]).squeeze(-1)  # (G, T - 1)
            texts = self.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
            rewards = torch.tensor([reward(t) for t in texts])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            for row in range(self.group):
                mask = np.zeros(out.shape[1], np.int64)
                mask[ids.shape[1]:] = 1
                old = np.concatenate([[0.0], logp[row].numpy()]).astype(np.float32)
                sample = RolloutSample(prompt=[], completion=[], input_ids=out[row].numpy(), completion_mask=mask,
                                       old_log_probs=old, advantage=float(advantages[row]), model_version=version,
                                       group_id=group_id, metrics={"reward": float(rewards[row])},
                                       enqueued_at=time.time())
                while not self.stopped.is_set():
                    try:
                        self.rollout_buffer.put(sample, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            group_id += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen3", help="a preset (random init) or a model path / Hub id")
    parser.add_argument("--vllm", action="store_true", help="TRL's own rollout worker and a running vLLM server")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (num_generations)")
    parser.add_argument("--max-completion-length", type=int, default=12)
    parser.add_argument("--output-dir", default="runs/trl-async")
    args = parser.parse_args()

    path = args.model
    if args.model in PRESETS:  # TRL's async trainer loads the model from a path
        path = tempfile.mkdtemp(prefix="trl-async-")
        load_model(args.model).save_pretrained(path)
    tokenizer = byte_tokenizer_hf() if args.model in PRESETS else load_tokenizer(args.model)
    config = LongStrawAsyncGRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, num_generations=args.group,
        per_device_train_batch_size=2 * args.group, max_completion_length=args.max_completion_length,
        learning_rate=1e-4, temperature=1.0, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        token_budget=None if args.vllm else 0, max_staleness=2, longstraw_plan="exact")
    # the sampler's copy gets the trained weights at the first sync, before the worker starts
    worker = None if args.vllm else GenerateWorker(load_model(path), tokenizer, args.group,
                                                   args.max_completion_length, config.temperature)
    trainer = LongStrawAsyncGRPOTrainer(
        path, args=config, processing_class=tokenizer, rollout_worker=worker, weight_transfer=worker,
        reward_funcs=None if worker else [lambda completions, **_: [reward(str(c)) for c in completions]],
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": p}] for p in PROMPTS]}))
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            encoded, flattened = entry["longstraw/tokens_encoded"], entry["longstraw/tokens_flattened"]
            print(f"step {entry['step']}: loss {entry['loss']:.4f}, reward {entry.get('reward', float('nan')):.3f}, "
                  f"tokens encoded {encoded:.0f} of {flattened:.0f}")


if __name__ == "__main__":
    main()
