"""Tree rollouts: forks continue their parent's state in place (no copy), the recorded log-probs equal a full forward
of every root-to-leaf trajectory, the depth and leaf budget hold, a seed reproduces the tree, and the advantages."""

from __future__ import annotations

import pytest
import torch
from helpers import gradient_tolerance, tiny_model

from longstraw.engine.loss.advantages import compute_advantages
from longstraw.engine.sampling import SamplingConfig
from longstraw.engine.tree.rollout import TreeConfig, TreeRollout, sample_tree, tree_advantages

PROMPT = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
EVERY3 = TreeConfig(trunks=2, branching=2, depth=3, leaves=6, trigger="tokens", every=3)
_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def _full_logprobs(model, response: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.cat([PROMPT, response])[None], use_cache=False).logits[0]
    return torch.log_softmax(logits[PROMPT.numel() - 1 : -1], -1).gather(1, response[:, None]).squeeze(1)


def _check_logprobs(model, rollout: TreeRollout, tol: float) -> None:
    for response, logp in zip(rollout.responses, rollout.logprobs, strict=True):
        assert float((_full_logprobs(model, response) - logp).abs().max()) <= tol


@pytest.mark.parametrize("family", ["llama", "mistral-sw", "qwen3_next-A",
                                    pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                    pytest.param("mamba2", marks=pytest.mark.slow)])
def test_branched_logprobs_equal_a_full_forward_of_each_trajectory(family):
    """Every leaf's response, decoded segment by segment over its ancestors' chunks (K/V, sliding windows, MLA
    latents, conv and recurrent state), scores as the unmodified model's forward over prompt + response: 1e-9 in
    float64, 10x the family's tolerance where its kernels compute in float32 inside."""
    model = _model(family)
    rollout = sample_tree(model, PROMPT, EVERY3, SamplingConfig(max_new_tokens=10, top_k=3), seed=1, chunk_size=8)
    assert rollout.stats["rollout_forks"] >= 3, "the test needs a tree of depth 3"
    assert max(n.depth for n in rollout.nodes) == 3
    tol = 1e-9 if gradient_tolerance(family) < 1e-9 else 10 * gradient_tolerance(family)
    _check_logprobs(model, rollout, tol)


def _frequent(model) -> int:
    free = sample_tree(model, PROMPT, TreeConfig(trunks=6, depth=1, leaves=6), SamplingConfig(max_new_tokens=30,
                                                                                              top_k=3), seed=2)
    return int(torch.cat(free.responses).bincount().argmax())


def _env(i: int, response: torch.Tensor) -> torch.Tensor:
    return torch.tensor([(5 * response.numel() + t) % 500 for t in range(3)])


def test_tool_call_forks_after_the_observation_and_masks_it():
    """Trigger tool_call: a node that forks ends with its observation's last token (fed into the parent, shared by
    the children, masked), its children start with the model's own token, and the log-probs equal a full forward."""
    model = _model("llama")
    call = _frequent(model)
    sampling = SamplingConfig(max_new_tokens=30, top_k=3, call_end=(call,), max_turns=4)
    rollout = sample_tree(model, PROMPT, TreeConfig(trunks=2, branching=2, depth=3, leaves=8), sampling, seed=0,
                          environment=_env)
    forked = [n for n in rollout.nodes if n.ended == "fork"]
    assert forked, "the test needs a fork"
    for node in forked:
        assert bool(node.observed[-3:].all()) and int(node.tokens[-4]) == call
        for child in node.children:
            assert not bool(rollout.nodes[child].observed[0])
            assert rollout.nodes[child].turns >= node.turns  # turns count along the path
    for mask in rollout.loss_masks:
        assert bool(mask[0]) and int((~mask).sum()) % 3 == 0
    assert sum(rollout.tool_calls) >= len(forked)
    _check_logprobs(model, rollout, 1e-9)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b


def test_forks_share_the_prompt_state_and_their_parents_segments():
    """A node's children decode over one state: the prompt's chunks are the capture's very tensors (a new list over
    them), each ancestor's segment chunk is the one its own fork made, and a segment's chunk is a view of the buffer
    its group decoded into (same storage): nothing is copied."""
    model = _model("qwen3_next-A")  # attention K/V and conv/recurrent state
    rollout = sample_tree(model, PROMPT, EVERY3, SamplingConfig(max_new_tokens=10, top_k=3), seed=1, chunk_size=8,
                          keep_states=True)
    prompt_state = rollout.state
    n_prompt = prompt_state.num_chunks
    assert rollout.states, "the test needs forks"
    checked_parts = set()
    for node, state in rollout.states.items():
        depth = rollout.nodes[node].depth
        assert state.num_chunks == n_prompt + depth
        for name, per_layer in state.parts.items():
            for layer, chunks in enumerate(per_layer):
                assert all(_same(a, b) for a, b in zip(chunks[:n_prompt], prompt_state.parts[name][layer],
                                                       strict=True))
                parent = rollout.nodes[node].parent
                if parent is not None:  # the ancestors' chunks are the parent's fork's own tensors
                    assert all(_same(a, b) for a, b in zip(chunks[: n_prompt + depth - 1],
                                                           rollout.states[parent].parts[name][layer], strict=True))
                own = chunks[-1]
                if own is None:
                    continue
                buffer = rollout.buffers[node]
                source = buffer.kv[layer][("key", "value").index(name)] if name in ("key", "value") else \
                    buffer.get(name, layer)
                assert own.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
                assert own.shape[0] == 1  # one row of the group's buffer, read by every child
                checked_parts.add(name)
    assert checked_parts == {"key", "value", "conv", "recurrent"}


@pytest.mark.parametrize("tree", [
    TreeConfig(trunks=1, branching=3, depth=2, leaves=3, trigger="tokens", every=2),
    TreeConfig(trunks=2, branching=2, depth=4, leaves=5, trigger="tokens", every=2),
    TreeConfig(trunks=3, branching=2, depth=1, leaves=3, trigger="tokens", every=1),
    TreeConfig(trunks=1, branching=4, depth=3, leaves=10, trigger="tokens", every=1),
])
def test_depth_and_leaf_budget_hold(tree):
    rollout = sample_tree(_model("llama"), PROMPT, tree, SamplingConfig(max_new_tokens=9, top_k=3), seed=3)
    forks = [n for n in rollout.nodes if n.children]
    assert len(rollout.leaves) == tree.trunks + len(forks) * (tree.branching - 1) <= tree.leaves
    assert all(len(n.children) == tree.branching and n.ended == "fork" for n in forks)
    assert max(n.depth for n in rollout.nodes) <= tree.depth
    assert all(r.numel() <= 9 for r in rollout.responses)
    # every=1 with room: the budget is spent as soon as forks are allowed
    if tree.every == 1 and tree.depth > 1:
        assert len(rollout.leaves) > tree.leaves - tree.branching + 1
    assert rollout.stats["rollout_tokens_sampled"] == sum(n.tokens.numel() for n in rollout.nodes)
    assert rollout.stats["rollout_tokens_flattened"] == sum(r.numel() for r in rollout.responses)


def test_a_seed_reproduces_the_tree_and_another_changes_it():
    model = _model("llama")
    sampling = SamplingConfig(max_new_tokens=8, top_k=8)
    a, b, c = (sample_tree(model, PROMPT, EVERY3, sampling, seed=s) for s in (5, 5, 6))
    assert [n.parent for n in a.nodes] == [n.parent for n in b.nodes]
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a.responses, c.responses))


def test_advantages_over_the_leaves_and_against_siblings():
    model = _model("llama")
    tree = TreeConfig(trunks=2, branching=2, depth=2, leaves=4, trigger="tokens", every=2)
    rollout = sample_tree(model, PROMPT, tree, SamplingConfig(max_new_tokens=6, top_k=3), seed=1)
    # trunks 0 and 1 fork: leaves 2, 3 (children of 0), 4, 5 (children of 1)
    assert rollout.leaves == [2, 3, 4, 5] and [rollout.nodes[i].parent for i in rollout.leaves] == [0, 0, 1, 1]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert torch.equal(tree_advantages(rewards, rollout, "grpo"), compute_advantages(rewards, "grpo"))
    assert tree_advantages(rewards, rollout, "siblings").tolist() == [0.5, -0.5, 0.0, 0.0]
    unforked = sample_tree(model, PROMPT, TreeConfig(trunks=2, branching=2, depth=2, leaves=3, trigger="tokens",
                                                     every=2), SamplingConfig(max_new_tokens=6, top_k=3), seed=1)
    # trunk 0 forks (leaves 2, 3); trunk 1 stays a leaf, compared with every leaf of the tree
    assert unforked.leaves == [1, 2, 3]
    assert tree_advantages(torch.tensor([1.0, 0.0, 0.5]), unforked, "siblings").tolist() == [0.5, -0.25, 0.25]
    with pytest.raises(ValueError, match="one per leaf"):
        tree_advantages(rewards[:3], rollout, "siblings")
    with pytest.raises(ValueError, match="grpo, siblings"):
        tree_advantages(rewards, rollout, "cousins")


def test_trajectories_build_the_training_tree():
    """The leaves as `Trajectory`s (prompt + response, loss from the response, observations masked, old log-probs)
    and their trie: shared tokens are encoded once."""
    model = _model("llama")
    rollout = sample_tree(model, PROMPT, EVERY3, SamplingConfig(max_new_tokens=10, top_k=3), seed=1)
    advantages = torch.linspace(-1, 1, len(rollout.leaves))
    trajectories = rollout.trajectories(advantages, group=2)
    assert [t.loss_start for t in trajectories] == [PROMPT.numel()] * len(rollout.leaves)
    assert all(t.group == 2 and torch.equal(t.old_logprobs, lp) for t, lp in zip(trajectories, rollout.logprobs))
    stats = rollout.tree(advantages).stats()
    assert stats["tree_leaves"] == len(rollout.leaves)
    assert stats["tokens_encoded"] <= PROMPT.numel() - 1 + rollout.stats["rollout_tokens_sampled"]
    assert stats["tokens_flattened"] == len(rollout.leaves) * (PROMPT.numel() - 1) + \
        rollout.stats["rollout_tokens_flattened"]
    with pytest.raises(ValueError, match="one per leaf"):
        rollout.trajectories(advantages[:-1])


@pytest.mark.parametrize("kwargs,match", [
    ({"branching": 1}, "branching must be an integer >= 2"),
    ({"trunks": 3, "leaves": 2}, "leaf budget"),
    ({"trigger": "sometimes"}, "tool_call, tokens"),
    ({"trigger": "tokens"}, "every must be an integer >= 1"),
    ({"every": 4}, "applies to trigger 'tokens'"),
])
def test_bad_tree_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeConfig(**kwargs)


def test_tool_call_trigger_without_an_environment_is_refused_before_any_compute(monkeypatch):
    import longstraw.engine.tree.rollout as rollout_module

    monkeypatch.setattr(rollout_module, "capture_prompt", lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(ValueError, match="need an environment"):
        sample_tree(_model("llama"), PROMPT, TreeConfig(), SamplingConfig(max_new_tokens=4))
