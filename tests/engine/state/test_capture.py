"""KV prompt state: chunked capture equals a full forward, forks share storage, nothing is written in place."""

import pytest
import torch
from helpers import tiny_model

from longstraw import planner
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.state.capture import capture_prompt, chunk_bounds


def _reference_kv(model, ids):
    """K/V from transformers' own DynamicCache after a plain full forward (the ground truth)."""
    with torch.no_grad():
        cache = model(input_ids=ids[None], use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk_size", [1, 7, 50, 1000])
def test_capture_equals_transformers_cache(family, chunk_size):
    model = tiny_model(family)
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(1))
    state = capture_prompt(model, ids, chunk_size)
    assert state.length == 50 and state.num_chunks == len(chunk_bounds(50, chunk_size))
    for layer, (k_ref, v_ref) in enumerate(_reference_kv(model, ids)):
        k = torch.cat(state.keys[layer], dim=-2)
        v = torch.cat(state.values[layer], dim=-2)
        assert (k - k_ref).abs().max() < 1e-12
        assert (v - v_ref).abs().max() < 1e-12


def test_state_bytes_match_design_formula():
    model = tiny_model("llama", dtype=torch.float32)
    cfg = model.config
    state = capture_prompt(model, torch.arange(37), chunk_size=10)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    expected = planner.state_bytes(planner.spec_from_config(cfg), 37, 4, 10, exact=True)[0]
    assert state.nbytes() == expected == 2 * 2 * head_dim * 4 * 37 * cfg.num_hidden_layers


def test_fork_and_leaves_share_storage():
    model = tiny_model("llama")
    state = capture_prompt(model, torch.arange(20), chunk_size=8)
    for a, b, c in zip(state.tensors(), state.fork().tensors(), state.as_leaves().tensors()):
        assert a.data_ptr() == b.data_ptr() == c.data_ptr()
    fork = state.fork()
    fork.keys[0].append(torch.zeros(1))
    assert len(state.keys[0]) == 3  # forks own their lists: appending to one never shows in another


def test_replays_never_write_into_the_state():
    model = tiny_model("llama")
    state = capture_prompt(model, torch.arange(30), chunk_size=8).as_leaves()
    before = [t.detach().clone() for t in state.tensors()]
    versions = [t._version for t in state.tensors()]
    for seed in range(3):
        seg = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(seed))
        run_segment(model, seg, 30, state.fork()).sum().backward()
    for t, b, ver in zip(state.tensors(), before, versions):
        assert torch.equal(t.detach(), b) and t._version == ver
        assert t.grad is not None  # the exact plan's leaves did receive gradient


def test_replay_continues_the_prompt_like_a_full_forward():
    """Hidden states of a replayed segment equal the full forward's at the same positions (micro-batch 2)."""
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (23,), generator=gen)
    segs = torch.randint(0, 512, (2, 5), generator=gen)
    state = capture_prompt(model, prompt, chunk_size=6)
    replayed = run_segment(model, segs, 23, state.fork())
    for row in range(2):
        full = model.model(input_ids=torch.cat([prompt, segs[row]])[None]).last_hidden_state[0, 23:]
        assert (replayed[row] - full).abs().max() < 1e-12


def _one_storage(chunks) -> bool:
    return len({t.untyped_storage().data_ptr() for t in chunks}) == 1


def test_capture_writes_full_attention_kv_into_one_tensor_per_layer():
    """`PromptState._slab`: the capture writes each full-attention layer's K and V chunks into one tensor per part,
    so they are adjacent views of it (a kernel reads them with one call), the values and bytes those of the chunks;
    the exact plan's leaves too, each chunk still its own leaf, kept capture graphs included; not an offloaded state."""
    import gc

    from longstraw.engine.kernels.attention import adjacent_runs

    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(1))
    state = capture_prompt(model, ids, chunk_size=12)
    leaves = capture_prompt(model, ids, chunk_size=12, leaves=True)
    kept = capture_prompt(model, ids, chunk_size=12, leaves=True, keep_graph=2)
    plain = capture_prompt(model, ids, chunk_size=50)  # one chunk: no slab needed to be one run
    assert state.num_chunks == 5 and state.nbytes() == leaves.nbytes() == plain.nbytes()
    for layer in range(state.num_layers):
        keys, values = state.keys[layer], state.values[layer]
        assert _one_storage(keys) and _one_storage(values) and not _one_storage(keys + values)
        assert keys[0].untyped_storage().nbytes() == sum(t.numel() * t.element_size() for t in keys)
        for a, b in zip(keys + values, leaves.keys[layer] + leaves.values[layer]):
            assert torch.equal(a, b)
        assert torch.allclose(torch.cat(keys, dim=2), plain.keys[layer][0], atol=1e-5)
        runs = adjacent_runs(keys, values)
        assert len(runs) == 1 and runs[0][2] == [12, 12, 12, 12, 2]
        assert torch.equal(runs[0][0], torch.cat(keys, dim=2)) and torch.equal(runs[0][1], torch.cat(values, dim=2))
        for chunks in (leaves, kept):
            assert _one_storage(chunks.keys[layer])
            assert len(adjacent_runs(chunks.keys[layer], chunks.values[layer])) == 1
            assert all(t.is_leaf and t.requires_grad and t.grad is None
                       for t in chunks.keys[layer] + chunks.values[layer])
    offloaded = capture_prompt(model, ids, chunk_size=12, offload=True)
    assert not _one_storage(offloaded.keys[0])
    gc.collect()


def test_the_capture_reads_earlier_chunks_as_one_run(monkeypatch):
    """Chunk j of the capture attends to chunks 0 ... j-1 with one kernel call per layer, not j calls: the state
    hands the whole prefix as one view of its tensor (`PromptState._copy_chunks`), so there is nothing to scan."""
    import longstraw.engine.kernels.attention as attention

    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(1))
    seen: list[tuple[int, int]] = []
    real = attention.adjacent_runs

    def counted(keys, values):
        runs = real(keys, values)
        seen.append((len(keys), len(runs)))
        return runs

    monkeypatch.setattr(attention, "adjacent_runs", counted)
    state = capture_prompt(model, ids, chunk_size=12)
    assert seen and set(seen) == {(1, 1)}  # every prefix read: one chunk in, one run
    (start, k, v), = state.attention_chunks(0)
    assert start == 0 and k.shape[2] == 50 and torch.equal(k, torch.cat(state.keys[0], dim=2))
    leaves = capture_prompt(model, ids, chunk_size=12, leaves=True)
    assert len(leaves.attention_chunks(0)) == 5  # leaves: each chunk its own (its own gradient)

def test_sliding_window_layers_are_not_coalesced():
    """Their old chunks are dropped as the window moves; one shared tensor would keep them alive."""
    model = tiny_model("gemma3-A", dtype=torch.float32)
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(2))
    state = capture_prompt(model, ids, chunk_size=12)
    windowed = [layer for layer, w in enumerate(state.windows) if w is not None]
    full = [layer for layer, w in enumerate(state.windows) if w is None]
    assert windowed and full
    assert all(not _one_storage(state.keys[layer]) for layer in windowed)
    assert all(_one_storage(state.keys[layer]) for layer in full)
