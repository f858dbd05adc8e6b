"""LongStraw: GRPO on very long shared prompts. Encode the prompt once, replay each response from its state.

The public names are imported on first use (PEP 562 `__getattr__`): `import longstraw` alone, and so the
`longstraw` command's `--version` and `--help`, do not import torch or transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from longstraw.choices import ADVANTAGES, LOSSES, PLANS

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES", "LOSSES", "PLANS", "SUPPORTED_MODEL_TYPES",
    "BackwardOptions", "LossConfig", "Plan", "Group", "GroupResult", "backward_group", "compute_advantages",
    "load_model",
    "Trajectory", "Tree", "TreeResult", "backward_tree", "build_tree",
]

if TYPE_CHECKING:
    from longstraw.admission.loading import load_model
    from longstraw.api.group import GroupResult, backward_group
    from longstraw.api.tree import TreeResult, backward_tree
    from longstraw.engine.group import Group
    from longstraw.engine.loss.advantages import compute_advantages
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.options import BackwardOptions
    from longstraw.engine.tree import Trajectory, Tree, build_tree
    from longstraw.models.architecture import SUPPORTED_MODEL_TYPES
    from longstraw.plan import Plan


# Where each public name lives, imported on first use.
_HOMES = {
    "GroupResult": "longstraw.api.group", "backward_group": "longstraw.api.group",
    "TreeResult": "longstraw.api.tree", "backward_tree": "longstraw.api.tree",
    "Trajectory": "longstraw.engine.tree", "Tree": "longstraw.engine.tree", "build_tree": "longstraw.engine.tree",
    "BackwardOptions": "longstraw.engine.options", "LossConfig": "longstraw.engine.loss.config",
    "Plan": "longstraw.plan", "Group": "longstraw.engine.group",
    "compute_advantages": "longstraw.engine.loss.advantages",
    "SUPPORTED_MODEL_TYPES": "longstraw.models.architecture", "load_model": "longstraw.admission.loading",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
