"""Architecture-aware prompt state: what later tokens need from the prompt, captured once."""

from longstraw.state.attention import KVState
from longstraw.state.capture import capture_prompt

__all__ = ["KVState", "capture_prompt"]
