"""Every model type LongStraw admits through TRL's asynchronous trainer (`make test-long`, outside CI: about 10 s a
type): a tiny copy of each admitted type's released config (admission's), two optimizer steps of
`LongStrawAsyncGRPOTrainer` against trl_async_setup's reference, within the type's admission tolerance (1e-9, or 1e-6
where its kernels compute in float32 inside the float64 model). A type admission refuses is not run (its verdict
says why); a type the drop-in refuses when it is built (a router term it cannot record, parameters transformers
keeps in float32 beside the load dtype) is reported with the reason. Dropout rates are set to 0, as a user loading
a model for RL does (LongStraw refuses train-mode randomness)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

from helpers import assert_close  # noqa: E402
from trl_async_setup import SETTINGS, samples, train_ours, train_reference  # noqa: E402

from longstraw.admission.released import causal_lm_types, sweep_config  # noqa: E402
from longstraw.admission.tiny import build_tiny_model, tiny_config  # noqa: E402
from longstraw.admission.verify import verdict_for  # noqa: E402

COUNT = SETTINGS["per_device_train_batch_size"] * (SETTINGS["gradient_accumulation_steps"] * SETTINGS["max_steps"] + 1)


@pytest.mark.long
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_admitted_type_trains_through_the_async_trainer(model_type, tmp_path):
    try:
        config = sweep_config(model_type)
        verdict = verdict_for(config)
    except Exception as err:  # a type this transformers cannot configure is not admitted either
        pytest.skip(f"{model_type}: no config ({type(err).__name__})")
    if verdict.kind == "refused":
        pytest.skip(f"{model_type}: refused by admission")
    tiny = tiny_config(config)[0]
    for key, value in tiny.to_dict().items():  # train-mode randomness at 0, as a user loading for RL sets it
        if (key.endswith(("dropout", "dropout_prob", "layerdrop", "pdrop")) or key == "router_jitter_noise") and \
                isinstance(value, float) and value > 0:
            setattr(tiny, key, 0.0)
    model = build_tiny_model(tiny)
    if getattr(model.config, "vocab_size", 0) < 64:
        pytest.skip(f"{model_type}: the tiny copy's vocabulary is under the samples' 64 token ids")
    attention = model.config._attn_implementation
    model.float().save_pretrained(tmp_path / "model")
    items = samples(COUNT)
    text = model.config.get_text_config()
    routed = hasattr(text, "output_router_logits") and bool(getattr(text, "router_aux_loss_coef", 0.0))
    # Trainer enables transformers' activation checkpointing when the config asks for it; CTRL has none
    kwargs = {"model_init_kwargs": {"attn_implementation": attention},
              "gradient_checkpointing": bool(model.supports_gradient_checkpointing)}
    try:
        steps, params = train_ours(str(tmp_path / "model"), items, str(tmp_path / "ours"), **kwargs)
    except ValueError as err:  # refused when the trainer is built, saying why: reported, not a failure
        assert "cannot train this configuration" in str(err), err
        print(f"{model_type}: refused by the drop-in: {str(err).splitlines()[1]}")
        return
    ref_steps, ref_params = train_reference(str(tmp_path / "model"), items, attention=attention,
                                            coef=float(text.router_aux_loss_coef) if routed else 0.0)
    errors = [assert_close(f"{model_type} gradient", b, a, verdict.tolerance) for a, b in zip(steps, ref_steps)]
    errors.append(assert_close(f"{model_type} parameters", ref_params, params, verdict.tolerance))
    print(f"{model_type}: {verdict.kind}, {max(errors):.2g}")
