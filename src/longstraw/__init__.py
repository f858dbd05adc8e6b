"""LongStraw: GRPO on very long shared prompts. Encode the prompt once, replay each response from its state.

The public names are imported on first use (PEP 562 `__getattr__`): `import longstraw` alone, and so the
`longstraw` command's `--version` and `--help`, do not import torch or transformers.
"""

from __future__ import annotations

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


def __getattr__(name: str) -> Any:
    if name in ("GroupResult", "backward_group"):
        from longstraw.api import group

        return getattr(group, name)
    elif name in ("TreeResult", "backward_tree"):
        from longstraw.api import tree as tree_api

        return getattr(tree_api, name)
    elif name in ("Trajectory", "Tree", "build_tree"):
        from longstraw.engine import tree

        return getattr(tree, name)
    elif name == "BackwardOptions":
        from longstraw.engine.options import BackwardOptions

        return BackwardOptions
    elif name == "LossConfig":
        from longstraw.engine.loss.config import LossConfig

        return LossConfig
    elif name == "Plan":
        from longstraw.plan import Plan

        return Plan
    elif name == "Group":
        from longstraw.engine.group import Group

        return Group
    elif name == "compute_advantages":
        from longstraw.engine.loss.advantages import compute_advantages

        return compute_advantages
    elif name == "SUPPORTED_MODEL_TYPES":
        from longstraw.models.architecture import SUPPORTED_MODEL_TYPES

        return SUPPORTED_MODEL_TYPES
    elif name == "load_model":
        from longstraw.admission.loading import load_model

        return load_model
    raise AttributeError(f"module 'longstraw' has no attribute {name!r}")
