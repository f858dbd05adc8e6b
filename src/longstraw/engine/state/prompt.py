"""The captured prompt state of every layer kind (docs/design.md §4), stored as the chunks the capture produced.

Per layer and capture chunk j the state holds whichever of these parts the layer produced:

* ``key`` / ``value`` — attention layers: the chunk's K/V, (1, Hkv, c_j, D), keys after RoPE; for latent attention
  (MLA: DeepSeek-V3, Kimi, GLM-5) what transformers caches instead, the compressed latent c_kv (1, 1, c_j, d_c) and
  the shared rope key (1, 1, c_j, d_R), which the attention kernel expands (`module.expand_kv`) a chunk at a time.
* ``index`` — DSA indexer keys (1, c_j, d_I), computed under no_grad by the reference model: never leaves.
* ``conv`` / ``recurrent`` — linear-attention / SSM layers (gated DeltaNet, KDA, Mamba2): the state *after*
  chunk j: the conv window (1, C, K) and the recurrent state ((1, H, d_k, d_v) or (1, H, d_h, N)).

Attention parts are never concatenated: replays read them in place, the exact plan's reverse prompt backward needs
exactly these chunk boundaries, and a fork is a new set of lists over the same tensors (no copy). Recurrent parts are
kept at every chunk boundary when `keep_boundaries` (the exact plan recomputes chunk j from the state after chunk j-1);
otherwise only the last one is kept, and sliding-window layers drop the K/V chunks no later token can see.

Offloaded state (`device` set): every part lives in host memory (pinned for a GPU) and is copied to `device` where it
is read (a layer's chunks by the attention kernel, a recurrent state by the cache), differentiably, so the exact
plan's leaves and gradients stay on the host. With per-layer activation checkpointing the device holds one layer's
copies (and their gradient) at a time; without it every layer's copy is saved and nothing is gained (the planner says
so). Prefetch (`prefetch`, default on a GPU): an attention layer's read starts the next attention layer's copies, on
CUDA on a side stream only the reading layer waits for, following the reads (up the layers in a forward, down in a
checkpointed backward's recomputes) at most one layer ahead: two layers' copies on the device. On the CPU the copies
are made at once (no overlap); the option runs there so that its bookkeeping and gradients are tested everywhere."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from longstraw.engine.state.path import PathSlab
from longstraw.engine.state.provenance import Provenance
from longstraw.engine.state.sharding import ContextShards

PARTS = ("key", "value", "index", "conv", "recurrent")
GRAD_PARTS = ("key", "value", "conv", "recurrent")  # `index` carries no gradient in the reference model
RECURRENT_PARTS = ("conv", "recurrent")

# What one chunk's forward produced: collected[layer][part] = tensor.
Collected = dict[int, dict[str, torch.Tensor]]


def prompt_fingerprint(ids: torch.Tensor) -> str:
    """Identity of the token ids a state holds: their count and a BLAKE2 hash of their int64 bytes, so that
    `backward_group` refuses a state captured for another prompt of the same length (a silently wrong gradient).
    Costs one host copy of the ids: 8 MB and a few ms for a million tokens."""
    data = ids.detach().to(device="cpu", dtype=torch.int64).contiguous()
    return f"{data.numel()}:{hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()}"


@dataclass
class PromptState:
    """State of prompt positions [0, length) for every layer. `parts[name][l][j]`: part `name` of layer l,
    chunk j (None where the layer has no such part or the entry was dropped)."""

    num_layers: int
    keep_boundaries: bool = True
    parts: dict[str, list[list[torch.Tensor | None]]] = field(default_factory=dict)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token range of each chunk
    layer_parts: list[frozenset[str]] | None = None  # which parts each layer produces (known after chunk 0)
    # Layers without a token mixer (Nemotron-H's MLP and MoE blocks: `architecture.stateless_layers`): they produce
    # no part, which for any other layer means its cache calls were lost (refused at the first chunk).
    stateless: frozenset[int] = frozenset()
    windows: list[int | None] = field(default_factory=list)  # sliding window per layer (None: full attention)
    # Context parallelism (`sharding.ContextShards`): this rank holds the attention parts of its own chunks only;
    # owners[j] is the rank that keeps chunk j's (decided when the chunk is captured, `capture.extend_state`).
    context_shards: ContextShards | None = None
    owners: list[int] = field(default_factory=list)
    device: torch.device | None = None  # offloaded: the compute device the host-memory tensors are copied to
    fingerprint: str | None = None  # `prompt_fingerprint` of the ids captured (None for a prefix of the state)
    provenance: Provenance | None = None  # what captured it (`provenance.provenance`)
    prefetch: bool | None = None  # offloaded (module docstring); None: on when `device` is a GPU
    # Capture chunk j's autograd graph, kept for the exact plan's prompt backward (`capture_prompt(keep_graph=)`):
    # the parts it produced, in `chunk_outputs` order. Forks and prefixes do not carry it.
    graphs: dict[int, list[torch.Tensor | None]] = field(default_factory=dict, repr=False, compare=False)
    capacity: int | None = None  # positions the capture will hold: full-attention K/V then go into slabs (`_slab`)
    # A depth-first walk's path past this state's first `path_first` chunks (`PathSlab`, `attach_path`); `floor`:
    # chunks below it are never dropped (`_drop_unneeded`: the walk's other branches continue them).
    path: PathSlab | None = field(default=None, repr=False, compare=False)
    path_first: int = 0
    floor: int = 0
    _slabs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    _ahead: _Prefetched | None = field(default=None, repr=False, compare=False)  # at most one layer ahead
    _last_read: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in PARTS:
            self.parts.setdefault(name, [[] for _ in range(self.num_layers)])
        if not self.windows:
            self.windows = [None] * self.num_layers
        if self.prefetch is None:
            self.prefetch = _prefetch_by_default(self.device)

    # --- shape of the state -------------------------------------------------------------------------------
    @property
    def keys(self) -> list[list[torch.Tensor | None]]:
        return self.parts["key"]

    @property
    def values(self) -> list[list[torch.Tensor | None]]:
        return self.parts["value"]

    @property
    def length(self) -> int:
        """Number of prompt positions held."""
        return self.bounds[-1][1] if self.bounds else 0

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    def fetch(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A tensor of the state where it is computed with: itself, or (offloaded) a differentiable copy on
        `device` (a copy even when `device` is the CPU, so the offloaded path runs, and is tested, everywhere)."""
        if t is None or self.device is None:
            return t
        return t.to(self.device, non_blocking=True, copy=True)

    def attention_chunks(self, layer: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start position, key part, value part) of every kept chunk of an attention layer."""
        ahead, self._ahead = self._ahead, None
        # A copy made under another grad mode would cut (or add) the path to the leaves: made again then.
        if ahead is not None and ahead.layer == layer and ahead.grad == torch.is_grad_enabled():
            chunks = ahead.take()
        else:
            chunks = self._copy_chunks(layer)
        del ahead  # a stale prefetch (another layer or grad mode) is freed before the next one starts
        if self.prefetch and self.device is not None:
            step = -1 if self._last_read is not None and layer < self._last_read else 1
            following = next((i for i in range(layer + step, self.num_layers if step > 0 else -1, step)
                              if any(k is not None for k in self.parts["key"][i])), None)
            if following is not None:
                self._ahead = _Prefetched.start(self, following)
        self._last_read = layer
        return chunks

    def _copy_chunks(self, layer: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        path = self.path
        if path is None or self.num_chunks == self.path_first or ("key", layer) not in path.tensors:
            return self._stored_chunks(layer, self.num_chunks)
        # The path's chunks as one view (one kernel call however deep the walk), after the chunks before it.
        return [*self._stored_chunks(layer, self.path_first), path.read(layer, self.length)]

    def _stored_chunks(self, layer: int, n: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, key, value) of chunks 0 … n − 1 of an attention layer, as stored."""
        keys, values = self.parts["key"][layer][:n], self.parts["value"][layer][:n]
        slab_k, slab_v = self._slabs.get(("key", layer)), self._slabs.get(("value", layer))
        if (slab_k is not None and slab_v is not None and keys and keys[0] is not None
                and not keys[0].requires_grad):
            # The chunks are views of one tensor (`_slab`) and need no gradient of their own: hand the whole prefix
            # as one view, so no reader scans the chunks for adjacency (decoding does so at every step and layer).
            end = self.bounds[n - 1][1]
            return [(0, slab_k[:, :, :end], slab_v[:, :, :end])]
        # misc: fetch is typed Optional, and v is not narrowed (a chunk's key and value are kept or dropped together).
        return [(self.bounds[j][0], self.fetch(k), self.fetch(v))  # type: ignore[misc]
                for j, (k, v) in enumerate(zip(keys, values)) if k is not None]

    def index_keys(self, layer: int) -> torch.Tensor | None:
        """DSA indexer keys of every prompt position, (1, length, d_I), or None if the layer has none."""
        chunks = [t for t in self.parts["index"][layer] if t is not None]
        return self.fetch(torch.cat(chunks, dim=1)) if chunks else None

    def last(self, part: str, layer: int) -> torch.Tensor | None:
        """The recurrent part of `layer` after the last chunk (what the next token continues from)."""
        entries = self.parts[part][layer]
        return self.fetch(entries[-1]) if entries else None

    # --- building -----------------------------------------------------------------------------------------
    def append_chunk(self, start: int, end: int, collected: Collected, leaves: bool = False) -> None:
        """Add what chunk [start, end) produced in every layer; `leaves`: as leaves (`as_leaves`). The sliding windows
        the attention kernel noted among the parts (`SegmentCache.note_window`) are taken out into `windows`."""
        for layer, parts in collected.items():
            window = parts.pop("window", None)
            if window is not None:
                self.windows[layer] = window  # type: ignore[call-overload]  # an int riding in the tensor dict
        if start != self.length:
            raise RuntimeError(f"chunk starts at {start} but the state holds {self.length} positions")
        on_path = self.path is not None and start >= self.path.start
        if self.capacity is not None and end > self.capacity and not on_path:
            raise RuntimeError(f"chunk ends at {end}, past the {self.capacity} positions this state was made for")
        produced = [frozenset(collected.get(layer, {})) for layer in range(self.num_layers)]
        if self.layer_parts is None:
            missing = [layer for layer, p in enumerate(produced) if not p and layer not in self.stateless]
            if missing:
                import transformers

                raise RuntimeError(f"chunk produced no state for layers {missing} (transformers "
                                   f"{transformers.__version__}): those layers never handed their state to LongStraw's "
                                   "cache, so replays would ignore the prompt")
            extra = [layer for layer, p in enumerate(produced) if p and layer in self.stateless]
            if extra:
                raise RuntimeError(f"layers {extra} have no token mixer but produced state parts")
            self.layer_parts = produced
        elif produced != self.layer_parts:
            raise RuntimeError(f"chunk produced state parts {produced}, expected {self.layer_parts}")
        for layer in range(self.num_layers):
            for name in PARTS:
                part = collected.get(layer, {}).get(name)
                if on_path and part is not None and self._slabbed(name, layer, part):
                    assert self.path is not None
                    self.parts[name][layer].append(self.path.write(name, layer, start, end, part))
                    continue
                slab = self._slab(name, layer, part)
                if slab is not None and part is not None:
                    slab.data[:, :, start:end].copy_(part.detach())  # `.data`: see `_slab`
                    part = slab[:, :, start:end]
                else:
                    part = self._store(part.detach() if leaves and part is not None else part)
                if leaves:
                    part = _leaf(name, part)
                self.parts[name][layer].append(part)
        self.bounds.append((start, end))
        if not self.keep_boundaries:
            self._drop_unneeded()

    def _slab(self, name: str, layer: int, part: torch.Tensor | None) -> torch.Tensor | None:
        """The (1, Hkv, capacity, D) tensor a full-attention layer's key or value chunks are written into, allocated at
        its first chunk; None where chunks are kept as computed. Chunk j is its view [start_j, end_j), so adjacent
        chunks are one run (`attention.adjacent_runs`) that readers read with one kernel call; the exact plan's leaves
        stay one per chunk (`ChunkAttention` splits a run's gradient back into its chunks). Chunks are written through
        `.data`, an alias with its own version counter: each region is written once, before anything reads it, and a
        kept capture graph that saved earlier chunks' leaves must not see the later writes as in-place changes of them.

        Not for: sliding-window layers (their old chunks are dropped, which a shared tensor would not free), a
        context-parallel or offloaded state (chunks dropped, or copied to the device one by one), a state without
        `capacity`, and parts that are not 4-D (MLA latents (1, 1, c, d) take one too: harmless, read per chunk)."""
        if part is None or self.capacity is None or not self._slabbed(name, layer, part):
            return None
        slab = self._slabs.get((name, layer))
        if slab is None:
            slab = part.new_empty((*part.shape[:2], self.capacity, part.shape[3]), requires_grad=False)
            self._slabs[(name, layer)] = slab
        if slab.shape[:2] != part.shape[:2] or slab.shape[3] != part.shape[3] or slab.dtype != part.dtype:
            raise RuntimeError(f"layer {layer} {name}: chunk of shape {tuple(part.shape)} {part.dtype}, the layer's "
                               f"earlier chunks were {tuple(slab.shape)} {slab.dtype}")
        return slab

    def _slabbed(self, name: str, layer: int, part: torch.Tensor) -> bool:
        """Whether a part goes into a slab (`_slab`'s "not for" list)."""
        return (name in ("key", "value") and part.dim() == 4 and self.context_shards is None and self.device is None
                and self.windows[layer] is None)

    def drop_attention(self, j: int) -> None:
        """Context parallelism: chunk j's attention parts live on another rank."""
        for name in ("key", "value", "index"):
            for layer in range(self.num_layers):
                self.parts[name][layer][j] = None

    def _drop_unneeded(self) -> None:
        """Without boundaries only the last recurrent state matters, and a sliding-window layer's K/V older
        than its window (W - 1 positions: the next token sees positions > its own − W) never will again."""
        low, last = self.floor, self.num_chunks - 1
        for layer in range(self.num_layers):
            for name in RECURRENT_PARTS:
                self.parts[name][layer][low:last] = [None] * max(last - low, 0)
            window = self.windows[layer]
            if window is not None:
                oldest_needed = self.length - (window - 1)
                for j in range(low, self.num_chunks):
                    if self.bounds[j][1] <= oldest_needed:
                        self.parts["key"][layer][j] = None
                        self.parts["value"][layer][j] = None

    def _store(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Where a part is kept: as computed, or (offloaded) in host memory, pinned for fast copies to a GPU. A view of
        a larger tensor (K/V sliced from a fused projection) is copied out so as not to keep its whole storage alive."""
        if t is None:
            return None
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        if self.device is None or t.device.type == "cpu":
            return t
        return t.detach().to("cpu").pin_memory()

    # --- forks and leaves ---------------------------------------------------------------------------------
    def _map(self, fn=None, num_chunks: int | None = None, device: torch.device | None = None) -> PromptState:
        """The first `num_chunks` chunks (default all) as a new state, each part mapped by fn(name, part) if given."""
        n = self.num_chunks if num_chunks is None else num_chunks
        return PromptState(
            num_layers=self.num_layers,
            keep_boundaries=self.keep_boundaries,
            parts={name: [layer[:n] if fn is None else [fn(name, t) for t in layer[:n]] for layer in per_layer]
                   for name, per_layer in self.parts.items()},
            bounds=self.bounds[:n],
            layer_parts=self.layer_parts,
            stateless=self.stateless,
            windows=list(self.windows),
            context_shards=self.context_shards,
            owners=self.owners[:n],
            device=self.device if device is None else device,
            fingerprint=self.fingerprint if n == self.num_chunks else None,  # a prefix holds other ids
            provenance=self.provenance,
            prefetch=self.prefetch if device is None else None,  # a state moved elsewhere: its device's default
            _slabs=self._slabs if device is None else {},  # read by forks and prefixes (which never append)
            path=self.path if fn is None else None,
            path_first=min(self.path_first, n) if fn is None else 0,
        )

    def prefix(self, num_chunks: int) -> PromptState:
        """A fork holding the first `num_chunks` chunks: new lists, the same tensors (no copy)."""
        return self._map(num_chunks=num_chunks)

    def fork(self) -> PromptState:
        """A view for one replay. Replays never write into it (recurrent parts are cloned where a layer
        would update them in place, see `engine.hf.cache`), so sharing the tensors is safe."""
        return self.prefix(self.num_chunks)

    def branch(self) -> PromptState:
        """A fork that grows: new chunks appended to it (`capture.extend_state`) are its own, the chunks it starts with
        are this state's tensors (no copy; an exact plan's leaves stay the same leaves, so the gradients the branch's
        recompute sends into them accumulate in this state's `.grad`). The branch reads its chunks one by one, not
        through this state's slabs, which hold this state's positions only."""
        if self.path is not None:
            raise RuntimeError("a state on a walk's path is continued in place (`attach_path`), not branched")
        branch = self._map()
        branch._slabs = {}
        branch.fingerprint = None
        return branch

    def attach_path(self, end: int, leaves: bool) -> None:
        """Continue this state in place along a depth-first walk (`engine/tree/plans.py`): chunks appended from here
        on are the path's, positions this state's length … end − 1, their full-attention K/V in a `PathSlab` (leaves
        that collect the gradient when `leaves`); leaving a node, the walk drops its chunks (`truncate`)."""
        self.path = PathSlab(start=self.length, capacity=end - self.length, leaves=leaves)
        self.path_first = self.num_chunks

    def detach_path(self) -> None:
        self.truncate(self.path_first)
        self.path, self.path_first = None, 0

    def truncate(self, n: int) -> None:
        """Drop chunks n … (the walk leaving a node whose chunks continued its parent's)."""
        for per_layer in self.parts.values():
            for layer in per_layer:
                del layer[n:]
        del self.bounds[n:], self.owners[n:]
        for j in [j for j in self.graphs if j >= n]:
            del self.graphs[j]

    def gradients(self, j: int) -> list[torch.Tensor | None]:
        """dL/d(what chunk j produced) the readers left, in `chunk_outputs` order (on the compute device): a part's
        `.grad`, or for a part on the path its positions in the path's gradient."""
        start, end = self.bounds[j]
        on_path = self.path is not None and j >= self.path_first
        out: list[torch.Tensor | None] = []
        for layer in range(self.num_layers):
            for name in GRAD_PARTS:
                t = self.parts[name][layer][j]
                if on_path and t is not None and (name, layer) in self.path.tensors:  # type: ignore[union-attr]
                    out.append(self.path.gradient(name, layer, start, end))  # type: ignore[union-attr]
                else:
                    out.append(None if t is None or t.grad is None else self.fetch(t.grad))
        return out

    def clear_gradients(self, j: int) -> None:
        """Free (or, on the path, zero) what `gradients(j)` returned: consumed."""
        start, end = self.bounds[j]
        on_path = self.path is not None and j >= self.path_first
        for name in GRAD_PARTS:
            for layer in range(self.num_layers):
                t = self.parts[name][layer][j]
                if on_path and t is not None and (name, layer) in self.path.tensors:  # type: ignore[union-attr]
                    self.path.clear(name, layer, start, end)  # type: ignore[union-attr]
                elif t is not None:
                    t.grad = None

    def offload(self, device: torch.device) -> PromptState:
        """The same state kept in host memory and read on `device` (see the module docstring)."""
        if self.device is not None:
            return self
        host = PromptState(num_layers=self.num_layers, device=torch.device(device))  # stores as offloaded
        return self._map(lambda name, t: host._store(t), device=host.device)

    def as_leaves(self) -> PromptState:
        """The same state as leaf tensors that require grad (the exact plan collects dL/dstate in .grad); `detach()`
        shares storage, so nothing is copied. Indexer keys stay constants."""
        return self._map(_leaf)

    # --- enumeration --------------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        return [t for per_layer in self.parts.values() for layer in per_layer for t in layer if t is not None]

    def chunk_outputs(self, j: int) -> list[torch.Tensor | None]:
        """The gradient-carrying parts chunk j produced, layer by layer in GRAD_PARTS order (None kept)."""
        return [self.parts[name][layer][j] for layer in range(self.num_layers) for name in GRAD_PARTS]

    @staticmethod
    def outputs_of(collected: Collected, num_layers: int) -> list[torch.Tensor | None]:
        """A recomputed chunk's parts, in the order of `chunk_outputs`."""
        return [collected.get(layer, {}).get(name) for layer in range(num_layers) for name in GRAD_PARTS]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _leaf(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """A part as a leaf: detached (no copy), requiring grad where the exact plan collects dL/dpart."""
    if t is None:
        return None
    return t.detach().requires_grad_(name in GRAD_PARTS and t.is_floating_point())


def _prefetch_by_default(device: torch.device | None) -> bool:
    """Prefetch pays where a copy can overlap compute: an offloaded state read on a GPU."""
    return device is not None and device.type == "cuda"


@dataclass
class _Prefetched:
    """One attention layer's chunk copies, started ahead of the read (module docstring), on CUDA on a side stream:
    `take` makes the reading stream wait for them and marks them used there (`record_stream`)."""

    layer: int
    chunks: list[tuple[int, torch.Tensor, torch.Tensor]]
    grad: bool  # the grad mode they were made under
    event: torch.cuda.Event | None = None

    @staticmethod
    def start(state: PromptState, layer: int) -> _Prefetched:
        device = state.device
        if device is None or device.type != "cuda":
            return _Prefetched(layer, state._copy_chunks(layer), torch.is_grad_enabled())
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)  # ordered after what this stream already queued (the pinned host sources)
        with torch.cuda.stream(side):
            chunks = state._copy_chunks(layer)
            event = torch.cuda.Event()
            event.record(side)
        return _Prefetched(layer, chunks, torch.is_grad_enabled(), event)

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        if self.event is not None and self.chunks:
            current = torch.cuda.current_stream(self.chunks[0][1].device)
            current.wait_event(self.event)
            for _, k, v in self.chunks:
                k.record_stream(current)
                v.record_stream(current)
        return self.chunks


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per GPU, made once (creating a stream per layer would cost a driver call each)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
