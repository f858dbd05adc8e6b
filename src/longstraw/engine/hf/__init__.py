"""The transformers adapter: everything that plugs LongStraw into transformers' unmodified model code.

* `segment`: `run_segment` runs a model's own modules over one segment and registers LongStraw's attention
  dispatch (`_longstraw_attention`) with transformers' `AttentionInterface`; the kernels stay in `engine.kernels`.
* `cache`: `SegmentCache`, the cache object that answers the layers' cache calls functionally over a prompt fork.
* `active`: the active-state context (which cache and run the attention dispatch reads).
* `mamba1`: the swap of Mamba-1 mixers' `forward` for one that continues the state through LongStraw's scan."""
