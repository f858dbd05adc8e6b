"""LongStraw's attention kernel refuses any attention argument it does not compute (`segment._check_kwargs`): a new
mechanism passed through transformers' attention interface (as gpt-oss' `s_aux` sinks were) must never be silently
dropped."""

import pytest
import torch
from helpers import tiny_model

from longstraw.engine.hf.segment import _check_kwargs, run_segment
from longstraw.engine.state.capture import capture_prompt


class _Attention(torch.nn.Module):
    layer_idx = 3


def test_harmless_keywords_pass():
    """What transformers 5.5-5.24 pass along for every supported family, and unset optional mechanisms."""
    _check_kwargs(_Attention(), dict(position_ids=torch.arange(4)[None], use_cache=False, output_attentions=False,
                                     is_causal=True, cache_position=torch.arange(4), cu_seq_lens_q=None,
                                     max_length_k=None, position_bias=None, sinks=None))


@pytest.mark.parametrize("kwargs,named", [
    (dict(cu_seq_lens_q=torch.tensor([0, 4]), cu_seq_lens_k=torch.tensor([0, 4])), "cu_seq_lens_k, cu_seq_lens_q"),
    (dict(max_length_q=4), "max_length_q"),  # packed sequences
    (dict(sinks=torch.zeros(4)), "sinks"),  # another family's name for attention sinks
    (dict(position_bias=torch.zeros(1, 4, 4, 4)), "position_bias"),  # T5-style relative position biases
    (dict(block_indices=torch.zeros(1, 4, 2, dtype=torch.long)), "block_indices"),
])
def test_a_keyword_that_changes_the_math_is_refused(kwargs, named):
    with pytest.raises(ValueError, match=rf"_Attention \(layer 3\) passes attention argument\(s\) {named} that "
                                         "LongStraw's attention does not compute"):
        _check_kwargs(_Attention(), {"position_ids": torch.arange(4)[None], **kwargs})


def test_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match=r"layer 3\) asks for bidirectional attention \(is_causal=False\)"):
        _check_kwargs(_Attention(), dict(is_causal=False))


def test_a_replay_refuses_an_unknown_attention_argument():
    """End to end: a hook hands layer 1's attention module an argument its forward passes on to the attention
    interface, as a family with a new mechanism would; the replay raises, naming it and the layer, instead of
    returning log-probs without it."""
    model = tiny_model("llama")
    state = capture_prompt(model, torch.arange(20), chunk_size=8)
    attention = model.model.layers[1].self_attn

    def add_bias(module, args, kwargs):
        return args, {**kwargs, "position_bias": torch.zeros(1)}

    hook = attention.register_forward_pre_hook(add_bias, with_kwargs=True)
    try:
        with pytest.raises(ValueError, match=r"LlamaAttention \(layer 1\) passes attention argument\(s\) "
                                             "position_bias"):
            run_segment(model, torch.randint(0, 512, (2, 3)), 20, state.fork())
    finally:
        hook.remove()
    run_segment(model, torch.randint(0, 512, (2, 3)), 20, state.fork())
