"""The lookup task as a TRL environment: TRL's GRPOTrainer with LongStraw's backward and `environment_factory`.

    python examples/trl_agent.py                                  # SmolLM2-135M-Instruct (`make demo` installs it)
    python examples/trl_agent.py --model tiny-qwen3 --steps 2 --max-completion-length 400   # a random-init preset

Each rollout gets its own `LookupEnvironment`: `reset` receives the dataset row (the directory's records), and its
method `lookup` is the tool. TRL renders the tool's description with its chat template (Qwen3's, whose ChatML tokens
are SmolLM2's own), parses the model's `<tool_call>` blocks, calls `lookup`, appends the result and generates the
continuation; the result's tokens are masked out of the loss (TRL's tool_mask, which the drop-in turns into
LongStraw's loss masks). The reward: 1 for the phone number in `<answer>...</answer>`, plus `get_reward`'s 0.2 per
successful lookup of the asked person (the environment owns that part). docs/agents.md ("From TRL").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

from datasets import Dataset
from trl.chat_template_utils import qwen3_chat_template

from longstraw import load_model
from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
from longstraw.models.presets import PRESETS
from longstraw.models.tokenizer import byte_tokenizer_hf, load_tokenizer
from longstraw.tasks.lookup import INSTRUCTIONS, LookupTask

TOOL_INSTRUCTIONS = ("You are an agent. The directory below gives each person's id; the phone number is in the "
                     "person's record, which the lookup tool reads. Call it with the person's id, then write "
                     "<answer>PHONE</answer>.\n\nDirectory:\n")
_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


class LookupEnvironment:
    """One rollout's environment: `reset(**row)` loads the row's directory records; `lookup` is the tool."""

    def reset(self, records: str, asked_id: int, **row: object) -> None:
        self.records = {int(k): v for k, v in json.loads(records).items()}
        self.asked_id, self.found = asked_id, False
        return None

    def lookup(self, person_id: int) -> str:
        """Reads the record of a person in the directory.

        Args:
            person_id: The person's id, as the directory lists it.
        """
        record = self.records.get(int(person_id))
        if record is None:
            return f"no person has id {person_id}"
        self.found = self.found or int(person_id) == self.asked_id
        return f"phone: {record[0]}, manager: {record[1]}"

    def get_reward(self) -> float:
        return 0.2 if self.found else 0.0


def answer_reward(completions: list, answer: list[str], **kwargs: object) -> list[float]:
    """1 where the completion's first <answer>...</answer> holds the phone number (over every assistant turn)."""
    out = []
    for completion, phone in zip(completions, answer):
        text = completion if isinstance(completion, str) else "".join(
            str(m.get("content") or "") for m in completion if m.get("role") == "assistant")
        found = _ANSWER.search(text)
        out.append(float(found is not None and found.group(1) == phone))
    return out


def dataset(task: LookupTask, n: int, seed: int) -> Dataset:
    """n lookup prompts as conversational rows, with the columns `reset` and the reward read."""
    rows: dict[str, list] = {"prompt": [], "answer": [], "records": [], "asked_id": []}
    rng = random.Random(seed)
    for _ in range(n):
        example = task.sample(rng)
        text = TOOL_INSTRUCTIONS + example.prompt.removeprefix(INSTRUCTIONS)
        rows["prompt"].append([{"role": "user", "content": text}])
        rows["answer"].append(example.answer)
        rows["records"].append(json.dumps({str(k): v for k, v in example.meta["records"].items()}))
        rows["asked_id"].append(example.meta["asked_id"])
    return Dataset.from_dict(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (real weights) or a preset")
    parser.add_argument("--people", type=int, default=60, help="people in each prompt's directory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-completion-length", type=int, default=160,
                        help="tokens per completion, tool results included (the byte preset needs ~400)")
    parser.add_argument("--output-dir", default=os.environ.get("OUTPUT_DIR", "runs/trl-agent"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's experimental-feature warning
    model = load_model(args.model)
    tokenizer = byte_tokenizer_hf() if args.model in PRESETS else load_tokenizer(args.model)
    tokenizer.chat_template = qwen3_chat_template  # renders tools; ChatML like SmolLM2's own template
    config = LongStrawGRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps, learning_rate=1e-5, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, longstraw_plan="exact", longstraw_chunk_size=512,
    )
    trainer = LongStrawGRPOTrainer(model, reward_funcs=answer_reward, args=config,
                                   train_dataset=dataset(LookupTask(n_people=args.people), 64, seed=0),
                                   processing_class=tokenizer, environment_factory=LookupEnvironment)
    trainer.train()
    print(f"trained {trainer.state.global_step} steps with environment_factory=LookupEnvironment")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
