"""A model's source checked before transformers loads it: whether the hub has the model (`check_hub`, in seconds), and a
config.json's values, refused in one line naming the file and field where they would otherwise end in a traceback
(transformers' validation, ZeroDivisionError, a tensor-size crash, a NaN in float64) or need the model's own code.

LongStraw never runs a model's own Python code (docs/architectures.md): every `from_pretrained` passes
`trust_remote_code=False`, and a config whose `auto_map` names classes for a model type transformers does not implement
is refused here (`custom_code_refusal`)."""

from __future__ import annotations

import json
import math
import os
from typing import Any, TypeGuard

from longstraw.choices import did_you_mean

HUB_TIMEOUT_S = 2.0  # how long the hub may take to say whether a model exists, before we give up and say so

# Refusal of a model that needs its own code (said by `load_config`, `load_model`, `longstraw check` and `train`).
CUSTOM_CODE = ("needs custom code (config.json's auto_map: {classes}) that LongStraw does not run (it has no "
               "--trust-remote-code option): use a model whose type transformers implements")


def read_config_json(path: str) -> dict[str, Any]:
    """A config.json's object; ValueError naming the file and line when unreadable, not UTF-8 JSON or not an object."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or type(err).__name__}): fix its permissions or "
                         "replace it") from None
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}): save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: not a transformers config.json")
    return data


def known_model_types() -> list[str]:
    from transformers import CONFIG_MAPPING

    return list(CONFIG_MAPPING.keys())


def custom_code_refusal(data: dict[str, Any], where: str) -> str | None:
    """Why a config.json's model cannot be loaded without running its own code, or None: an `auto_map` with a
    `model_type` transformers does not implement (or none)."""
    auto_map = data.get("auto_map")
    if not auto_map or data.get("model_type") in known_model_types():
        return None
    classes = ", ".join(str(v) for v in auto_map.values()) if isinstance(auto_map, dict) else str(auto_map)
    return f"{where}: model type {data.get('model_type')!r} " + CUSTOM_CODE.format(classes=classes[:200])


def check_local_config(data: dict[str, Any], where: str) -> None:
    """Every check of this module on one config.json's values (ValueError, one line naming `where`)."""
    why = custom_code_refusal(data, where)
    if why is not None:
        raise ValueError(why)
    model_type = data.get("model_type")
    if model_type is None:
        raise ValueError(f"{where} has no model_type: not a transformers config.json")
    types = known_model_types()
    if model_type not in types:
        import transformers

        raise ValueError(f"{where}: model_type {model_type!r}{did_you_mean(model_type, types)} is not a model type "
                         f"of transformers {transformers.__version__}: fix the config or upgrade transformers")
    check_head_counts(data, where)
    check_head_grouping(data, where)
    check_values(data, where)


_POSITIVE_SIZES = ("head_dim", "hidden_size", "num_hidden_layers", "vocab_size")


def check_head_counts(values: dict[str, Any], where: str) -> None:
    """Refuse a head count below 1 (`num_attention_heads`, `num_key_value_heads`, `linear_num_value_heads`, ..., in
    a nested text config too), or a `head_dim`, `hidden_size`, `num_hidden_layers` or `vocab_size` below 1, before
    transformers' config or model or the planner divides by it (a ZeroDivisionError or ValueError traceback) or samples
    from an empty vocabulary; None stays allowed (transformers' "same as the heads", or a size derived from others)."""
    for key, value in sorted(values.items()):
        if isinstance(value, dict):
            check_head_counts(value, where)
        elif not isinstance(key, str) or not isinstance(value, int) or isinstance(value, bool) or value >= 1:
            continue
        elif key.endswith("heads"):
            raise ValueError(f"{where}: {key} = {value}; a model needs at least one head (the head size and the "
                             "grouping of query heads per key/value head divide by it): fix the config")
        elif key in _POSITIVE_SIZES:
            raise ValueError(f"{where}: {key} = {value}; a model needs {key} >= 1 (its layers and their sizes are "
                             "built from it): fix the config")


def check_head_grouping(values: dict[str, Any], where: str) -> None:
    """Refuse key/value heads not dividing the attention heads (in a nested text config too): they crash attention."""
    for value in values.values():
        if isinstance(value, dict):
            check_head_grouping(value, where)
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if is_int(heads) and is_int(kv) and heads >= 1 and kv >= 1 and heads % kv:
        raise ValueError(f"{where}: {kv} key-value heads do not divide {heads} attention heads (each key-value head "
                         "serves a whole group of query heads): fix num_key_value_heads")


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON and config values)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_values(values: dict[str, Any], where: str) -> None:
    """Refuse a NaN or infinite number anywhere in the config (nested too), a negative epsilon (`rms_norm_eps`,
    `layer_norm_epsilon`, ...: the norm then divides by the root of a negative number) and a `rope_theta` that is
    not positive, named as such rather than as a float64 overflow in the check."""
    for key, value in sorted(values.items(), key=lambda item: str(item[0])):
        if isinstance(value, dict):
            check_values(value, where)
            continue
        if isinstance(value, list):
            bad = next((v for v in value if isinstance(v, float) and not math.isfinite(v)), None)
            if bad is not None:
                raise ValueError(f"{where}: {key} holds {bad}: every number of a config must be finite: fix the config")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if not math.isfinite(value):
            raise ValueError(f"{where}: {key} = {value}; every number of a config must be finite: fix the config")
        name = str(key)
        if (name.endswith("eps") or name.endswith("epsilon")) and value < 0:
            raise ValueError(f"{where}: {key} = {value}; a norm's epsilon must be >= 0 (the norm divides by "
                             f"sqrt(variance + {key})): fix the config")
        if name == "rope_theta" and value <= 0:
            raise ValueError(f"{where}: rope_theta = {value}; the rotary base must be > 0: fix the config")


def validation_error(err: Exception, where: str) -> ValueError:
    """transformers' error for a config it refuses (its strict-dataclass validation: a float where an int belongs,
    fields that contradict each other) as one line naming `where`."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return ValueError(f"{where}: transformers refuses this config: {text[:400]}: fix the config")


def remote_code_error(err: Exception, name: str) -> ValueError | None:
    """transformers' `trust_remote_code=False` refusal (a cached model needing its own code) in one line; else None."""
    if "trust_remote_code" not in str(err):
        return None
    return ValueError(f"model {name!r} " + CUSTOM_CODE.format(classes="see its config.json"))


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set."""
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def choices() -> str:
    """What a model name may be, for error messages."""
    from longstraw.models.gguf_files import PACKAGED_GGUF
    from longstraw.models.presets import PRESETS

    return (f"a preset ({', '.join(PRESETS)}), a packaged model ({', '.join(PACKAGED_GGUF)}), a local directory "
            "or .gguf file, or a Hugging Face id (owner/name)")


def check_hub(name: str) -> None:
    """Ask the hub whether `name` exists, with a short timeout, so an unknown id or an unreachable hub fails in
    seconds with a message (transformers alone retries for ~30 s, then raises a traceback)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ValueError(f"model {name!r} is gated on the Hugging Face Hub: accept its terms on its page and log in "
                         "(hf auth login), or pass a local directory") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {name!r} was not found on the Hugging Face Hub (or is private: log in with hf auth "
                         f"login). Use {choices()}") from None
    except HfHubHTTPError as err:
        raise ValueError(f"model {name!r}: the Hugging Face Hub refused the request ({err})") from None
    except Exception as err:  # network errors: DNS, refused connection, timeout, proxy
        raise ValueError(
            f"model {name!r} is not in the local cache and the Hugging Face Hub could not be reached within "
            f"{HUB_TIMEOUT_S:g} s ({type(err).__name__}: {err}). Download it where the hub is reachable "
            f"(hf download {name}) and pass its directory, or use {choices()}"
        ) from None
