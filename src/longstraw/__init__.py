"""LongStraw: GRPO on very long shared prompts. Encode the prompt once, replay each response from its state.

The public names are imported on first use (PEP 562 `__getattr__`): `import longstraw` alone, and so the
`longstraw` command's `--version` and `--help`, do not import torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longstraw.choices import ADVANTAGES, LOSSES, PLANS
from longstraw.choices import MODES as MODES  # the older name of PLANS, kept for importers

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES", "LOSSES", "PLANS", "SUPPORTED_MODEL_TYPES",
    "Group", "GroupResult", "backward_group", "compute_advantages", "load_model",
]

if TYPE_CHECKING:
    from longstraw.api import GroupResult, backward_group
    from longstraw.group import Group
    from longstraw.loss import compute_advantages
    from longstraw.models import SUPPORTED_MODEL_TYPES, load_model


def __getattr__(name: str) -> Any:
    if name in ("GroupResult", "backward_group"):
        from longstraw import api

        return getattr(api, name)
    elif name == "Group":
        from longstraw.group import Group

        return Group
    elif name == "compute_advantages":
        from longstraw.loss import compute_advantages

        return compute_advantages
    elif name in ("SUPPORTED_MODEL_TYPES", "load_model"):
        from longstraw import models

        return getattr(models, name)
    raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
