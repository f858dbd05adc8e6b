"""examples/trl_agent.py: the lookup task as a TRL `environment_factory` environment with LongStraw's backward.
The example trains 2 steps on a tiny preset; the environment, its tool and the reward are checked on their own, and
one scripted tool call runs through TRL's loop: the result is the environment's, masked in TRL's tool_mask."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location("trl_agent", os.path.join(ROOT, "examples", "trl_agent.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_environment_its_tool_and_the_reward():
    ex = _example()
    from longstraw.tasks.lookup import LookupTask

    rows = ex.dataset(LookupTask(n_people=12), 2, seed=0)
    row = rows[0]
    env = ex.LookupEnvironment()
    assert env.reset(**row) is None and env.get_reward() == 0.0
    records = json.loads(row["records"])
    phone, manager = records[str(row["asked_id"])]
    assert env.lookup(row["asked_id"]) == f"phone: {phone}, manager: {manager}" and env.get_reward() == 0.2
    assert env.lookup(17) == "no person has id 17"
    assert "<lookup>" not in row["prompt"][0]["content"] and "lookup tool" in row["prompt"][0]["content"]
    good = [{"role": "assistant", "content": f"<answer>{row['answer']}</answer>"}]
    assert ex.answer_reward([good, [{"role": "assistant", "content": "<answer>1</answer>"}]],
                            answer=[row["answer"], row["answer"]]) == [1.0, 0.0]


def test_the_example_trains_two_steps_with_a_scripted_tool_call(tmp_path, monkeypatch):
    """The example's own main() on tiny-qwen3 for 2 steps; TRL's generation is scripted so that one completion per
    group calls `lookup` with the asked id: the environment answers (its reward part is paid) and TRL masks the
    result."""
    from trl import GRPOTrainer

    ex = _example()
    masks, rewards = [], []
    original = GRPOTrainer._generate_and_score_completions

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        eos = self.processing_class.eos_token_id
        out = []
        for k, ids in enumerate(prompt_ids):
            text = self.processing_class.decode(ids)
            asked = text.rsplit("Question: What is the phone number of ", 1)[-1].split("?")[0]
            line = [x for x in text.splitlines() if x.startswith(asked + " -> id ")]
            if num_generations > 1 and k % num_generations == 0 and line:
                pid = line[0].split()[-1]
                body = f'<tool_call>\n{{"name": "lookup", "arguments": {{"person_id": {pid}}}}}\n</tool_call><|im_end|>'
            else:
                body = "I do not know.<|im_end|>"
            out.append(list(body.encode()) + [eos])
        return out, None

    def recorded(self, inputs):
        batch = original(self, inputs)
        masks.append(batch["tool_mask"].clone())
        rewards.append([e.get_reward() for e in self.environments])
        return batch

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", scripted)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", recorded)
    assert ex.main(["--model", "tiny-qwen3", "--steps", "2", "--people", "10",
                    "--max-completion-length", "400", "--output-dir", str(tmp_path / "out")]) == 0
    assert len(masks) == 2
    for mask, paid in zip(masks, rewards):
        masked = (mask == 0).sum(1).tolist()  # tool-result tokens per completion
        assert masked[0] > 0 and all(n == 0 for n in masked[1:4]), masked
        assert paid[0] == 0.2 and paid[1:4] == [0.0, 0.0, 0.0]
