"""The `SegmentCache` of the segment running now, for attention kernels that are not handed it as a keyword.

`run_segment` passes its cache to the decoder twice: as the model's cache argument and as the `longstraw` keyword,
which most families pass on through their decoder layers' and attention modules' **kwargs to the attention kernel.
Some attention modules call the kernel without the keyword arguments their layer was given (StableLM and Nemotron
call `self_attn(...)` with named arguments only): the kernel then finds the cache here, set for the duration of the
segment's forward, and of each checkpointed layer's recompute in the backward (`activation_checkpointing`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longstraw.engine.hf.cache import SegmentCache

_ACTIVE: ContextVar[SegmentCache | None] = ContextVar("longstraw_segment_cache", default=None)


@contextmanager
def running(cache: SegmentCache) -> Iterator[None]:
    """`cache` is the active segment's within the block (nested blocks restore the outer one)."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_cache() -> SegmentCache | None:
    """The cache of the segment running now, or None outside `running`."""
    return _ACTIVE.get()
