"""`python -m benchmarks decode`: the smoke run end to end (every field, G x N tokens per side, prompt-cache bytes
exactly G times apart), bad options refused, a failed side recorded, and transformers' side decoding the same model as
LongStraw's. (LongStraw's own sampled log-probs against a full forward: tests/engine/test_sampling.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model

from benchmarks import decode
from benchmarks.__main__ import build_parser, main
from benchmarks.decode import SHAPES, format_table, hf_generate, hf_prefill, shape_from_args
from longstraw.engine.sampling import score_responses
from longstraw.models.architecture import cache_keyword
from longstraw.models.presets import PRESETS

PHASE_KEYS = {"time_s", "cpu_time_s", "cpu_pressure", "peak_bytes", "peak_absolute_bytes", "peak_source", "hwm_reset"}
SIDE_KEYS = {"status", "prefill", "decode", "cache_bytes", "tokens_generated", "tokens_per_s"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode") / "decode.json"
    assert main(["decode", "--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_smoke_run_writes_every_field(smoke):
    shape = SHAPES["smoke"]
    assert smoke["bench"] == "decode" and smoke["smoke"] and smoke["shape"]["model"] == shape.model
    assert smoke["torch_threads"] >= 1 and smoke["machine"]["cpu_count"] and "finished" in smoke
    assert smoke["sampling"]["top_k"] == 0 and smoke["sampling"]["transformers_attention_mask"] == "all ones"
    assert [e["prompt_tokens"] for e in smoke["results"]] == list(shape.prompts)
    for e in smoke["results"]:
        assert e["status"] == "ok" and e["tokens_ok"], e
        for side in ("longstraw", "transformers"):
            r = e[side]
            assert set(r) == SIDE_KEYS, r
            assert set(r["prefill"]) == set(r["decode"]) == PHASE_KEYS
            assert r["prefill"]["time_s"] > 0 and r["decode"]["time_s"] > 0
            assert r["tokens_generated"] == e["expected_tokens"] == shape.group_size * shape.new_tokens
            assert r["tokens_per_s"] == pytest.approx(r["tokens_generated"] / r["decode"]["time_s"])
        assert e["tokens_per_s_ratio"] == pytest.approx(e["longstraw"]["tokens_per_s"]
                                                        / e["transformers"]["tokens_per_s"])
        assert e["prefill_time_ratio"] > 0


def test_prompt_cache_bytes_are_the_kv_cache_and_g_times_apart(smoke):
    """tiny-llama fp32: K and V of P - 1 positions per layer, LongStraw once, transformers G times."""
    config = PRESETS["tiny-llama"]()
    head_dim = config.hidden_size // config.num_attention_heads
    g = SHAPES["smoke"].group_size
    for e in smoke["results"]:
        kv = config.num_hidden_layers * 2 * config.num_key_value_heads * (e["prompt_tokens"] - 1) * head_dim * 4
        assert e["longstraw"]["cache_bytes"] == kv
        assert e["transformers"]["cache_bytes"] == g * kv
        assert e["cache_bytes_ratio"] == g


def test_table_has_a_row_per_prompt(smoke):
    table = format_table(smoke)
    for e in smoke["results"]:
        assert f"| {e['prompt_tokens']} |" in table
    assert "ok (8 + 8)" in table and "bench decode: tiny-llama" in table


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    (["--group-size", "0"], "argument --group-size: must be >= 1, got 0"),
    (["--new-tokens", "-3"], "argument --new-tokens: must be >= 1, got -3"),
    (["--chunk-size", "x"], "argument --chunk-size: expected an integer, got 'x'"),
    (["--dtype", "float7"], "argument --dtype: invalid choice"),
])
def test_bad_options_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["decode", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m benchmarks decode" in err and message in err


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "8", "1"], "every P must be >= 2"),
    (["--device", "tpu"], "--device must be cpu or cuda[:i], got 'tpu'"),
])
def test_bad_values_are_refused_through_the_subcommands_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m benchmarks decode" in err and message in err


def test_options_override_the_shape(monkeypatch):
    # --device cuda:1 is checked to exist: this CPU test stands in a machine with two GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(["decode", "--prompts", "4096", "4096", "512", "--group-size", "4",
                                      "--new-tokens", "8", "--chunk-size", "1024", "--device", "cuda:1",
                                      "--model", "gpu-llama-1b", "--dtype", "bfloat16"])
    shape = shape_from_args(args, args.fail)
    assert (shape.prompts, shape.group_size, shape.new_tokens, shape.chunk_size) == ((4096, 512), 4, 8, 1024)
    assert (shape.model, shape.dtype, shape.device) == ("gpu-llama-1b", "bfloat16", "cuda:1")
    default = shape_from_args(build_parser().parse_args(["decode"]), args.fail)
    assert default == SHAPES["b1"] and default.prompts == (8192, 32768, 131072)


def test_a_failing_side_is_recorded_and_the_exit_status_says_so(tmp_path, monkeypatch, capsys):
    def broken(model, prompt, shape):
        if prompt.numel() == 128:
            raise RuntimeError("out of memory (simulated)")
        return real(model, prompt, shape)

    real = decode.transformers_side
    monkeypatch.setattr(decode, "transformers_side", broken)
    out = tmp_path / "decode.json"
    assert main(["decode", "--smoke", "--out", str(out)]) == 1
    first, second = json.loads(out.read_text())["results"]
    assert first["status"] == "ok"
    assert second["status"] == "failed" and not second["tokens_ok"] and "tokens_per_s_ratio" not in second
    assert second["longstraw"]["status"] == "ok"
    assert second["transformers"] == {"status": "failed", "error": "RuntimeError: out of memory (simulated)"}
    assert "transformers failed" in format_table(json.loads(out.read_text()))


def test_transformers_side_decodes_the_same_model():
    """The bench's transformers path (prefill, cache repeated G times, generate) on a prompt full of the pad id
    decodes the model a full forward over prompt + response computes, and so does LongStraw's scoring of the same
    tokens (capture, replay), float64. generate hands its logits back cast to float32 (transformers' sampling loop
    does so), so its logits must be the full forward's rounded to float32 (relative 2**-24); LongStraw's log-probs
    the full forward's within 1e-9. Without the explicit attention mask generate would mask every prompt position
    holding the pad id, and its logits would differ (checked too)."""
    model = tiny_model("llama")  # float64, sdpa
    g, n = 3, 5
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(11))
    prompt[::4] = decode.PAD_TOKEN_ID
    p = prompt.numel()
    cache = hf_prefill(model, prompt)
    cache.batch_repeat_interleave(g)
    out = hf_generate(model, prompt, cache, g, n, seed=2, output_logits=True, return_dict_in_generate=True)
    responses = list(out.sequences[:, p:])
    assert all(r.numel() == n for r in responses) and len({tuple(r.tolist()) for r in responses}) > 1
    theirs = torch.stack(out.logits, dim=1)  # (G, N, V), float32
    assert theirs.dtype == torch.float32
    ours = score_responses(model, prompt, responses, chunk_size=16)
    with torch.no_grad():
        for i, response in enumerate(responses):
            full = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0, p - 1 : -1]
            assert bool(((theirs[i].double() - full).abs() <= full.abs() * 2**-24 + 1e-12).all())
            reference = torch.log_softmax(full, -1).gather(1, response[:, None]).squeeze(1)
            assert float((ours[i] - reference).abs().max()) <= 1e-9

    # The mask matters: generate left to infer it from pad_token_id sees another prompt.
    cache = hf_prefill(model, prompt)
    cache.batch_repeat_interleave(g)
    torch.manual_seed(2)
    unmasked = model.generate(prompt[None].expand(g, -1), max_new_tokens=n, min_new_tokens=n,
                              do_sample=True, top_k=0, eos_token_id=None, pad_token_id=decode.PAD_TOKEN_ID,
                              output_logits=True, return_dict_in_generate=True, **{cache_keyword(model): cache})
    assert float((unmasked.logits[0] - out.logits[0]).abs().max()) > 1e-3
