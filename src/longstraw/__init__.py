"""LongStraw: GRPO on very long shared prompts. Encode the prompt once, replay each response from its state."""

from longstraw.api import MODES, GroupResult, backward_group
from longstraw.group import Group
from longstraw.loss import ADVANTAGES, LOSSES, compute_advantages
from longstraw.models import SUPPORTED_MODEL_TYPES, load_model

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES", "LOSSES", "MODES", "SUPPORTED_MODEL_TYPES",
    "Group", "GroupResult", "backward_group", "compute_advantages", "load_model",
]
