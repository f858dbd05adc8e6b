"""The families admitted on the CI list (`SUPPORTED_MODEL_TYPES`) through their verification: each family's config
with a released checkpoint's values (`released.RELEASED`; the class defaults elsewhere) passes `verify`, and a second,
independent measurement on another shape agrees (prompt 61 in 16-token chunks, micro-batches of 2, another seed):
`exact` equals `standard` within the verdict's tolerance, and `detach` does not (the prompt state matters). The check
runs in the default suite, the second measurement in `make test-slow`.

`test_every_decoder_only_text_type` (slow: ~10 min on 2 cores) runs every type of transformers' causal-LM mapping:
none is admitted and wrong (every admitted type passes the second measurement), at least 90 decoder-only text types
are admitted, and every refusal names a measured difference or the mechanism that failed."""

from __future__ import annotations

import pytest
from helpers import grads, random_group, rel_err

from longstraw import backward_group
from longstraw.admission import check, released, verify
from longstraw.admission.tiny import build_tiny_model, tiny_config
from longstraw.models import architecture

# Families admitted through verification and kept on the CI list (the fast path). The families with tests of their
# own in tests/engine/state/test_architectures.py are not repeated here.
VERIFIED_FAMILIES = (
    "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "phi3", "phimoe", "olmo", "olmo2", "olmo3", "smollm3", "seed_oss",
    "exaone4", "lfm2", "starcoder2", "gpt_neox", "glm", "glm4", "glm4_moe_lite", "apertus", "arcee", "bitnet",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "ernie4_5", "ernie4_5_moe", "dots1", "minimax_m2", "deepseek_v2",
    "deepseek_v32", "bamba", "ministral", "olmo_hybrid", "qwen3_5_moe_text", "gpt2", "gemma", "helium", "phi",
)


def second_measurement(config, tolerance: float) -> tuple[float, float]:
    """(exact vs standard relative gradient error, detach vs standard) on another shape and seed than `verify`'s."""
    tiny, _ = tiny_config(config)
    model = build_tiny_model(tiny, seed=1)
    vocab = model.get_input_embeddings().num_embeddings
    group = random_group(61, [7, 2, 12], seed=3, vocab=vocab)
    out = {}
    for plan in ("standard", "exact", "detach"):  # an unlisted type is admitted by its (cached) check first
        model.zero_grad(set_to_none=True)
        result = backward_group(model, group, plan=plan, chunk_size=16, micro_batch=2)
        out[plan] = (grads(model).clone(), result.logprobs)
    (g_std, lp_std), (g_exact, lp_exact) = out["standard"], out["exact"]
    for a, b in zip(lp_std, lp_exact):
        assert float((a - b).abs().max()) <= tolerance
    return rel_err(g_exact, g_std), rel_err(out["detach"][0], g_std)


@pytest.mark.parametrize("model_type", VERIFIED_FAMILIES)
def test_family_is_verified_and_on_the_ci_list(model_type):
    assert model_type in architecture.SUPPORTED_MODEL_TYPES
    verdict = verify.verify(released.sweep_config(model_type))
    assert verdict.admitted, verdict.summary()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", VERIFIED_FAMILIES)
def test_family_second_measurement(model_type):
    config = released.sweep_config(model_type)
    verdict = verify.verify(config)
    exact, detach = second_measurement(config, verdict.tolerance)
    assert exact <= verdict.tolerance, f"{model_type}: exact vs standard {exact:.3g} > {verdict.tolerance:g}"
    assert detach > 1e-3, f"{model_type}: detach equals standard ({detach:.3g}): the prompt state is not exercised"


@pytest.mark.slow
def test_every_decoder_only_text_type():
    admitted, refused = [], []
    for model_type in released.causal_lm_types():
        if model_type in released.NOT_DECODER_ONLY_TEXT:
            continue
        row = check._row(model_type)
        if row["kind"] == "refused":
            refused.append(row)
            why = check._short(row)
            named = ("off by", "the check crashed", "cannot be built", "no tiny copy", "refused:", "wraps a")
            assert any(word in why for word in named), f"{model_type}: refusal without a measured reason: {why}"
            continue
        admitted.append(model_type)
        exact, _ = second_measurement(released.sweep_config(model_type), row["tolerance"])
        assert exact <= row["tolerance"], f"{model_type} admitted but exact vs standard is {exact:.3g}"
    assert len(admitted) >= 90, f"{len(admitted)} admitted, {len(refused)} refused"
