"""Memory planner behind `longstraw plan`: per-GPU bytes of one GRPO step for every plan, before renting GPUs.

From a transformers config (a preset, a built-in description of a paper-scale model, a directory or
`config.json`, or a cached hub id) this module derives a `ModelSpec` (layer kinds, dimensions, parameter counts
from a meta-device instantiation: no weights are allocated) and predicts, per plan, the peak of one
`backward_group` call plus the optimizer state that lives beside it.

How the peak is composed (`PlanEstimate.phases`): a resident part (weights, optimizer, prompt state and its
gradient, runtime) plus the largest of the phases a step goes through:

* capture (detach/exact): the state being built + one no-grad chunk's transient tensors;
* replay (detach/exact): the saved activations of one micro-batch of k responses + the chunked log-prob's
  transient (forward: logits and logsumexp's temporary, 2·c·V; backward: recomputed logits + the output
  projection's weight-gradient temporary, c·V + V·d). Parameter gradients are resident from the second
  micro-batch on; with a single micro-batch they grow while activations are freed (max, not sum);
* prompt backward (exact): one chunk's activations recomputed with grad (the last layer stops at its K/V)
  + the state gradient;
* standard: the activations of full `P + R` sequences (one, or all G when batched) + three `[R, V]`
  log-softmax tensors alive at the start of the backward.

Activation bytes per token and layer are counted from the tensors autograd saves in transformers' layers and
in LongStraw's attention kernel (RMSNorm: an fp32 copy of the input + the normalised input + the weighted
output, (4 + 2b)·width; SwiGLU MLP: 4·I·b; attention through `prefix_attention`: q, k and v repeated to H
heads, q regrouped for the prefix, the output projection's input (5·H·D·b) and two partial outputs in the
accumulation dtype (2·H·D·a); standard attention through SDPA: (2·H·D + 2·Hkv·D)·b). Full-attention
families (llama, qwen2/3, mistral) are validated against measured peaks (tests/test_planner.py); the
formulas for linear attention, Mamba2, MLA, DSA and MoE layers are counted the same way from transformers'
torch paths. Recurrent layers (gated DeltaNet, Mamba2: `RecurrentBytes`) are counted per segment, padded to
their scan's chunk, with the no-grad capture's transient and the backward's; b1-mamba2 and b1-qwen3-next
(3 gated-DeltaNet + 1 attention layer, MoE) are validated against measured peaks for standard, detach and exact
with and without checkpointing (within 10%, slow test; bench/results/recurrent-*-clone.json).
The prompt-state formulas of every family are pinned exactly against captured states
(tests/state/test_architectures.py).

Multi-GPU assumptions: FSDP/ZeRO-3 divides weights, gradients and optimizer state over the GPUs and gathers
one decoder layer at a time (two in flight: prefetch) plus that layer's unsharded gradient; MoE experts are
assumed expert-parallel (sharded, never gathered). Context parallelism `cp` divides the attention part of the
prompt state (and its gradient) of detach/exact over `cp` GPUs; every rank keeps all recurrent states (each runs
every chunk, `StateBytes.per_rank`); the standard plans are not context-parallel.

Memory levers, as the engine implements them: `checkpoint_layers` (checkpointing.py: each layer's input, plus one
layer's activations and backward buffers while it is recomputed) and `offload_state` (the state and its gradient
in host memory, one layer's copies on the device; saves nothing without checkpointing).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field

PLANS = ("standard_batched", "standard", "detach", "exact")
MIB = 1024**2
GIB = 1024**3

# The step memory a fresh CPU process adds beyond its tensors (thread pools, BLAS/oneDNN workspaces, the
# autograd engine's threads). Measured, not derived: 20-22 MiB on every b1-llama configuration of Bench B1
# (the residual of the formulas below), 11 MiB on tiny-llama. On CUDA it is not counted by
# max_memory_allocated; there `reserve_bytes` (CUDA context, NCCL buffers, allocator fragmentation) applies.
CPU_RUNTIME_BYTES = 20 * MIB
DEFAULT_CUDA_RESERVE = 2 * GIB
# Assumed query-block of a DSA indexer scoring a prompt (fp32 scores, reduced over indexer heads).
DSA_SCORE_ROWS = 256
# Chunk length of the chunked gated-delta-rule / Mamba2 scan, whose per-chunk states autograd keeps.
LINEAR_SCAN_CHUNK = 64
MAMBA_SCAN_CHUNK = 256

DTYPE_BYTES = {
    "float64": 8, "fp64": 8, "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
}


# ---------------------------------------------------------------- built-in model descriptions


def hybrid_27b():
    """A 27B-class gated-DeltaNet/attention hybrid in the style of Qwen3.5/3.6 (Qwen3-Next layer pattern):
    64 layers, 3 linear-attention layers per full-attention layer, hidden 5120, dense SwiGLU MLP 17408,
    GQA 24/4 heads of 256, linear attention 16 key / 48 value heads of 128, vocab 248320.

    Dimensions are our reading of public descriptions, not an official config; the parameter count comes out
    at 26.9B (computed by the planner from a meta-device instantiation).
    """
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
        max_position_embeddings=2**22,
    )


def glm5_class():
    """A GLM-5-class MLA + DSA mixture of experts: transformers' `GlmMoeDsaConfig` defaults (78 layers,
    hidden 6144, 256 routed experts of 2048 + 1 shared, 8 per token, MLA latent 512 + rope 64, indexer
    32 heads of 128, top-k 2048): 744B parameters, ~40B active."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(max_position_embeddings=2**22)


BUILTIN_NAMES = ("hybrid-27b", "glm5-class")


def load_config(name: str):
    """A transformers config from a built-in name, a LongStraw preset, a directory or config.json, or a hub id.

    Raises ValueError (with what is accepted) when nothing matches.
    """
    from longstraw.models import PACKAGED_GGUF, PRESETS, converted_gguf, resolve_model_path

    if name == "hybrid-27b":
        return hybrid_27b()
    elif name == "glm5-class":
        return glm5_class()
    elif name in PRESETS:
        return PRESETS[name]()
    elif name in PACKAGED_GGUF or name.endswith(".gguf"):  # a packaged real model: the config of its converted copy
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(converted_gguf(resolve_model_path(name)))
    elif name.endswith(".json") and os.path.isfile(name):
        from transformers import AutoConfig

        with open(name) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise ValueError(f"{name} has no model_type: not a transformers config.json")
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    elif os.path.isdir(name):
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(f"directory {name!r} has no config.json")
        return AutoConfig.from_pretrained(name)
    else:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(name)
        except Exception as err:  # transformers raises OSError, ValueError, HTTP errors ... for a bad id
            raise ValueError(
                f"unknown model {name!r}: give a built-in description ({', '.join(BUILTIN_NAMES)}), a preset "
                f"({', '.join(PRESETS)}), a directory holding config.json, a config.json path, or a hub id "
                f"reachable from here ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from None


# ---------------------------------------------------------------- model description


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs from a config. `mixers[l]`: attention | sliding | linear | mamba | mla | dsa |
    attention+mamba (Falcon-H1's parallel heads); `mlps[l]`: dense | moe | none. Sizes are element counts."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    mixers: tuple[str, ...]
    mlps: tuple[str, ...]
    params: int
    expert_params: int  # routed-expert parameters (expert-parallel under sharding)
    max_layer_params: int  # largest decoder layer without its routed experts (what FSDP gathers)
    tied: bool = False
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    attn_gate: bool = False  # Qwen3-Next/3.5 gated attention: q_proj also yields a sigmoid gate
    window: int = 0
    intermediate: int = 0
    moe_intermediate: int = 0
    experts_per_token: int = 0
    num_experts: int = 0
    shared_intermediate: int = 0
    lin_key_heads: int = 0
    lin_value_heads: int = 0
    lin_key_dim: int = 0
    lin_value_dim: int = 0
    conv_kernel: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_chunk: int = MAMBA_SCAN_CHUNK  # the config's chunk size of the Mamba2 scan (it pads segments to it)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_layers: tuple[bool, ...] = field(default_factory=tuple)  # DSA: layer keeps its own indexer keys
    max_positions: int = 0  # the config's max_position_embeddings (0: none given)

    @property
    def num_layers(self) -> int:
        return len(self.mixers)


PLANNER_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1",
    "deepseek_v3", "glm_moe_dsa", "kimi_linear",
)


def _count_params(config) -> tuple[int, int, int]:
    """(total, routed-expert, largest layer without experts) parameters, from a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = expert = 0
    per_layer: dict[int, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        is_expert = ".experts." in name
        if is_expert:
            expert += p.numel()
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m and not is_expert:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + p.numel()
    return total, expert, max(per_layer.values(), default=0)


def _attention_dims(c) -> dict[str, int]:
    heads = c.num_attention_heads
    return {
        "heads": heads, "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
    }


def _moe_layers(c, n: int) -> tuple[str, ...]:
    """DeepSeek-style: the first `first_k_dense_replace` layers dense, the rest MoE (or `mlp_layer_types`)."""
    types = getattr(c, "mlp_layer_types", None)
    if types:
        return tuple("moe" if t == "sparse" else "dense" for t in types)
    k = getattr(c, "first_k_dense_replace", 0) or 0
    return tuple("dense" if i < k else "moe" for i in range(n))


def spec_from_config(config, name: str = "") -> ModelSpec:
    """Read layer kinds and dimensions from a transformers config (text config of a multimodal wrapper)."""
    c = getattr(config, "text_config", None) or config
    mt = c.model_type
    n = c.num_hidden_layers
    total, expert, max_layer = _count_params(c)
    base: dict[str, object] = {
        "name": name or mt, "model_type": mt, "hidden": c.hidden_size, "vocab": c.vocab_size,
        "params": total, "expert_params": expert, "max_layer_params": max_layer,
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
        "max_positions": int(getattr(c, "max_position_embeddings", 0) or 0),
    }
    layer_types = list(getattr(c, "layer_types", None) or [])
    if mt in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text"):
        window = getattr(c, "sliding_window", None) or 0
        if not layer_types:
            uses = getattr(c, "use_sliding_window", True) and window
            layer_types = ["sliding_attention" if uses else "full_attention"] * n
        mixers = tuple("sliding" if t == "sliding_attention" else "attention" for t in layer_types)
        return ModelSpec(
            **base, mixers=mixers, mlps=("dense",) * n, **_attention_dims(c),
            qk_norm=mt in ("qwen3", "gemma3_text"), window=window, intermediate=c.intermediate_size,
        )
    elif mt in ("qwen3_next", "qwen3_5_text"):
        mixers = tuple("linear" if t == "linear_attention" else "attention" for t in layer_types)
        if mt == "qwen3_next":
            mlps = tuple("dense" if i in (c.mlp_only_layers or []) or c.num_experts == 0
                         or (i + 1) % c.decoder_sparse_step else "moe" for i in range(n))
            moe = {"moe_intermediate": c.moe_intermediate_size, "experts_per_token": c.num_experts_per_tok,
                   "num_experts": c.num_experts, "shared_intermediate": c.shared_expert_intermediate_size}
        else:
            mlps, moe = ("dense",) * n, {}
        return ModelSpec(
            **base, mixers=mixers, mlps=mlps, **_attention_dims(c), qk_norm=True, attn_gate=True,
            intermediate=c.intermediate_size, lin_key_heads=c.linear_num_key_heads,
            lin_value_heads=c.linear_num_value_heads, lin_key_dim=c.linear_key_head_dim,
            lin_value_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim, **moe,
        )
    elif mt == "mamba2":
        return ModelSpec(
            **base, mixers=("mamba",) * n, mlps=("none",) * n, mamba_heads=c.num_heads,
            mamba_head_dim=c.head_dim, mamba_state=c.state_size, mamba_groups=c.n_groups,
            conv_kernel=c.conv_kernel, mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
        )
    elif mt == "falcon_h1":
        heads = c.mamba_n_heads
        head_dim = c.mamba_d_head if c.mamba_d_head != "auto" else c.mamba_expand * c.hidden_size // heads
        return ModelSpec(
            **base, mixers=("attention+mamba",) * n, mlps=("dense",) * n, **_attention_dims(c),
            intermediate=c.intermediate_size, mamba_heads=heads, mamba_head_dim=head_dim,
            mamba_state=c.mamba_d_state, mamba_groups=c.mamba_n_groups, conv_kernel=c.mamba_d_conv,
            mamba_chunk=getattr(c, "mamba_chunk_size", None) or MAMBA_SCAN_CHUNK,
        )
    elif mt == "kimi_linear":  # KDA layers (linear attention, one head set) + MLA layers, MoE FFNs
        mixers = tuple("linear" if t == "linear_attention" else "mla" for t in layer_types)
        return ModelSpec(
            **base, mixers=mixers, mlps=_moe_layers(c, n), heads=c.num_attention_heads,
            kv_heads=c.num_attention_heads, head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
            intermediate=c.intermediate_size, moe_intermediate=c.moe_intermediate_size,
            experts_per_token=c.num_experts_per_token, num_experts=c.num_experts,
            shared_intermediate=(c.num_shared_experts or 0) * c.moe_intermediate_size,
            q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank, qk_rope_dim=c.qk_rope_head_dim,
            qk_nope_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim, lin_key_heads=c.linear_num_heads,
            lin_value_heads=c.linear_num_heads, lin_key_dim=c.linear_head_dim, lin_value_dim=c.linear_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
        )
    elif mt in ("deepseek_v3", "glm_moe_dsa"):
        if mt == "glm_moe_dsa":
            types = list(getattr(c, "indexer_types", None) or ["full"] * n)
            mixers = tuple("dsa" if t != "shared" else "mla" for t in types)
            index_layers = tuple(t != "shared" for t in types)
            index = {"index_heads": c.index_n_heads, "index_dim": c.index_head_dim}
        else:
            mixers, index_layers, index = ("mla",) * n, (), {}
        return ModelSpec(
            **base, mixers=mixers, mlps=_moe_layers(c, n), heads=c.num_attention_heads,
            kv_heads=c.num_attention_heads, head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
            intermediate=c.intermediate_size, moe_intermediate=c.moe_intermediate_size,
            experts_per_token=c.num_experts_per_tok, num_experts=c.n_routed_experts,
            shared_intermediate=(c.n_shared_experts or 0) * c.moe_intermediate_size,
            q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank, qk_rope_dim=c.qk_rope_head_dim,
            qk_nope_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim, index_layers=index_layers, **index,
        )
    else:
        raise ValueError(
            f"the planner has no formulas for model_type {mt!r}; it knows {', '.join(PLANNER_MODEL_TYPES)}"
        )


# ---------------------------------------------------------------- per-layer formulas (DESIGN §4)


def _recurrent_bytes(spec: ModelSpec, mixer: str, b: int) -> int:
    """One copy of a recurrent layer's state: conv window (b) + recurrent state (fp32), constant in P."""
    if mixer == "linear":
        conv = (2 * spec.lin_key_heads * spec.lin_key_dim + spec.lin_value_heads * spec.lin_value_dim)
        rec = spec.lin_value_heads * spec.lin_key_dim * spec.lin_value_dim
        return conv * spec.conv_kernel * b + rec * 4
    elif mixer in ("mamba", "attention+mamba"):
        inner = spec.mamba_heads * spec.mamba_head_dim
        conv = inner + 2 * spec.mamba_groups * spec.mamba_state
        rec = spec.mamba_heads * spec.mamba_head_dim * spec.mamba_state
        return conv * spec.conv_kernel * b + rec * 4
    else:
        return 0


def _per_token_state_bytes(spec: ModelSpec, layer: int, b: int) -> tuple[int, int]:
    """(bytes per prompt token that carry a gradient, bytes per token that do not) of one layer's state."""
    mixer = spec.mixers[layer]
    if mixer in ("attention", "sliding", "attention+mamba"):
        return 2 * spec.kv_heads * spec.head_dim * b, 0
    elif mixer in ("mla", "dsa"):
        keys = spec.index_dim * b if mixer == "dsa" and spec.index_layers[layer] else 0
        return (spec.kv_lora_rank + spec.qk_rope_dim) * b, keys
    else:
        return 0, 0


@dataclass(frozen=True)
class StateBytes:
    """The prompt state of one sequence, split by where context parallelism puts it: the attention part (K/V,
    MLA latents, DSA indexer keys: sharded over the cp ranks) and the recurrent part (conv/recurrent states:
    every rank computes every chunk, so every rank holds them all). `*_grad`: the exact plan's state gradient.
    `largest_layer`: the attention part of the largest layer (what an offloaded state copies to the device)."""

    attention: int
    attention_grad: int
    recurrent: int
    recurrent_grad: int
    largest_layer: int

    def per_rank(self, cp: int) -> tuple[int, int]:
        """(state, state gradient) on one of `cp` context-parallel ranks."""
        return (math.ceil(self.attention / cp) + self.recurrent,
                math.ceil(self.attention_grad / cp) + self.recurrent_grad)


def state_parts(spec: ModelSpec, positions: int, b: int, chunk: int, exact: bool) -> StateBytes:
    """The prompt state for `positions` prompt tokens, one sequence (see `state_bytes`)."""
    att = att_grad = rec_total = rec_grad = largest = 0
    boundaries = max(1, math.ceil(positions / chunk))
    for layer, mixer in enumerate(spec.mixers):
        kept = positions
        if mixer == "sliding" and spec.window and not exact:
            # detach drops whole capture chunks that end before the last W-1 positions; exact keeps them all
            # (its reverse prompt backward reads them as boundaries)
            kept = positions - chunk * (max(0, positions - (spec.window - 1)) // chunk)
        with_grad, without = _per_token_state_bytes(spec, layer, b)
        att += kept * (with_grad + without)
        att_grad += kept * with_grad
        largest = max(largest, kept * (with_grad + without))
        rec = _recurrent_bytes(spec, mixer, b)
        rec_total += rec * (boundaries if exact else 1)
        rec_grad += rec
    return StateBytes(att, att_grad if exact else 0, rec_total, rec_grad if exact else 0, largest)


def state_bytes(spec: ModelSpec, positions: int, b: int, chunk: int, exact: bool) -> tuple[int, int]:
    """(prompt state, its gradient in the exact plan) for `positions` prompt tokens, one sequence.

    Attention K/V and MLA latents grow with P (sliding layers in detach: the chunks reaching into the last W-1
    positions); DSA indexer keys grow but carry no gradient; recurrent layers hold one state (detach) or one per
    chunk boundary (exact), and their gradient is one state's worth.
    """
    parts = state_parts(spec, positions, b, chunk, exact)
    return parts.per_rank(1)


def _norm(width: int, b: int) -> int:
    """RMSNorm's saved tensors per token: fp32 input copy, normalised input, weighted output."""
    return (4 + 2 * b) * width


def _padded(tokens: int, chunk: int) -> int:
    """`tokens` rounded up to a multiple of `chunk` (the torch scans pad a segment to whole chunks)."""
    return -(-tokens // chunk) * chunk


@dataclass(frozen=True)
class RecurrentBytes:
    """Bytes of one recurrent token mixer (gated DeltaNet/KDA: `linear`; Mamba2) over a segment of `batch` rows of
    `tokens` tokens, counted on transformers' torch paths (`torch_chunk_gated_delta_rule`, Mamba2's
    `torch_forward`/`mamba2_chunk_scan`; no flash-linear-attention or mamba_ssm kernels, which keep far less).
    Both scans pad the segment to whole chunks of their own (`LINEAR_SCAN_CHUNK`, the config's Mamba2 chunk size),
    so a 128-token replay through a 256-chunk Mamba2 scan costs 256 tokens in every scan-sized tensor.

    saved: what autograd saves for the backward in a forward with grad. tail: of it, what is saved after the layer's
    state is produced (gated norm, output projection): a prompt-backward chunk whose forward stops at the last
    layer's state does not save it. nograd: the live transient of a no-grad forward of the layer (the capture).
    backward: the transient of its backward beyond the saved tensors. (The conv window and state the segment cache
    keeps are copies of a few columns, counted with the state: `_recurrent_bytes`.)"""

    saved: int
    tail: int
    nograd: int
    backward: int


RECURRENT_MIXERS = ("linear", "mamba", "attention+mamba")


def recurrent_bytes(spec: ModelSpec, mixer: str, tokens: int, b: int, batch: int = 1,
                    cached: bool = True) -> RecurrentBytes:
    """`RecurrentBytes` of a `linear`, `mamba` or `attention+mamba` (its Mamba2 heads) mixer; zeros otherwise.
    cached: the segment runs through LongStraw's `SegmentCache` (capture, replay, prompt backward); the standard plans
    run the model without a cache (no conv concatenation)."""
    if mixer == "linear":
        kd, vd = spec.lin_key_heads * spec.lin_key_dim, spec.lin_value_heads * spec.lin_value_dim
        conv, hv = 2 * kd + vd, spec.lin_value_heads
        w = max(vd, hv * spec.lin_key_dim)  # q/k repeated to the value heads, v: Hv x d per token
        c = LINEAR_SCAN_CHUNK
        state = hv * spec.lin_key_dim * spec.lin_value_dim * 4
        tp = _padded(tokens, c)
        nc = tp // c
        # Saved (per-layer saved-tensor hooks on b1-qwen3-next at T = 100, 128, 700, 704, 2048: within -1 … +8%):
        # the conv input and the conv's output (2 x conv_dim, param dtype); ~20 fp32 tensors of Hv x d (q/k/v made
        # contiguous, normalised, padded, k·beta, v·beta, the UT solve's outputs, decayed q/k, the core output, the
        # gated norm's), counted per real token: a padded segment saves no more of them than an unpadded one (700
        # tokens saved less than 704); six fp32 intra-chunk (c x c) matrices per value head (decays, k·kᵀ, q·kᵀ, the
        # UT system), per padded token; three recurrent states per chunk.
        saved = tokens * (2 * conv * b + 20 * w * 4) + tp * 6 * hv * c * 4 + 3 * nc * state
        tail = tokens * (5 * vd * 4 + vd * b)  # gated RMSNorm (fp32) and the output projection's input
        # No grad: the in_proj outputs, the conv input and its activation, three c x c matrices and ~9 Hv x d fp32
        # tensors alive at the chunk loop (measured: 26.7 KB per token with the residual stream; this 25.7 KB).
        in_proj = 2 * kd + 2 * vd + 2 * hv
        nograd = tokens * ((in_proj + 2 * conv) * b + 9 * w * 4) + tp * 3 * hv * c * 4
        backward = tp * hv * c * 4
    elif mixer in ("mamba", "attention+mamba"):
        h, hd, n = spec.mamba_heads, spec.mamba_head_dim, spec.mamba_state
        inner = h * hd
        conv = inner + 2 * spec.mamba_groups * n
        proj = inner + conv + h  # in_proj output: gate, x/B/C, dt
        c = spec.mamba_chunk
        state = h * hd * n * 4
        tp = _padded(tokens, c)
        nc = tp // c
        # Counted on `mamba2_chunk_scan` with saved-tensor hooks (b1-mamba2: 104.96 KB per token and layer at
        # T = 2048, 168.8 KB at T = 128, i.e. 256 padded; tiny-mamba2 and a 768-wide, 24-head, N = 128 shape
        # within 1.3%): per token the in_proj output, the conv input (cached: concatenated with the window), its
        # output and activation, the gated norm's four fp32 tensors and the output projection's input, dt; per
        # padded token three fp32 (c x c) matrices per head (the decay L, C·Bᵀ, the masked product copied for
        # bmm), B and C repeated to the heads with their bmm copies (5 x H·N; 3 with a single chunk in the batch),
        # four H x hd tensors (3 with a single chunk); two chunk states per chunk.
        multi = batch * nc > 1
        per_token = proj * b + (3 if cached else 2) * conv * b + 4 * inner * 4 + inner * b + 3 * h * 4
        per_padded = (3 * c + (5 if multi else 3) * n + (4 if multi else 3) * hd + 2) * h * 4
        saved = tokens * per_token + tp * per_padded + 2 * (nc + 1) * state
        tail = tokens * (4 * inner * 4 + inner * b)
        # No grad, measured on the three shapes at T = 2048 (89.6 / 32.9 / 194.9 KB per token with the residual
        # stream; this gives 90.7 / 33.4 / 196.7): the in_proj output, the conv input and activation; the scan's
        # L, C·Bᵀ and their product (locals alive to its end), B and C padded and repeated (3 x H·N) and ~8 H x hd
        # tensors (x·dt, D·x, the diagonal and off-diagonal outputs and their bmm operands).
        nograd = tokens * (proj + 2 * conv) * b + tp * (3 * c + 3 * n + 8 * hd) * h * 4
        # Backward beyond the saved tensors: about one c x c gradient per head (measured 12.2-18.4 KB per token
        # on the three shapes at T = 2048; this 8.2-24.6 KB).
        backward = tp * h * c * 4
    else:
        return RecurrentBytes(0, 0, 0, 0)
    return RecurrentBytes(*(batch * x for x in (saved, tail, nograd, backward)))


def _recurrent_layers(spec: ModelSpec) -> list[int]:
    return [i for i, m in enumerate(spec.mixers) if m in RECURRENT_MIXERS]


def _mixer_activation_bytes(spec: ModelSpec, mixer: str, b: int, a: int, kernel: str) -> int:
    """Saved bytes per token of one token mixer. kernel: 'replay' (LongStraw's prefix attention, with a
    prefix), 'own' (prefix attention without a prefix: the first chunk), 'sdpa' (the standard plans).
    Recurrent mixers (gated DeltaNet, Mamba2) pad to their scan chunk and are counted per segment by
    `recurrent_bytes`: here they count 0 (Falcon-H1's parallel attention heads count)."""
    if mixer in ("attention", "sliding", "attention+mamba", "mla", "dsa"):
        h = spec.heads
        if mixer in ("mla", "dsa"):
            qk, v = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
            # latent projections: q_a/kv_a outputs normalised, q_b/kv_b outputs, k assembled from nope + rope
            proj = _norm(spec.q_lora_rank, b) + _norm(spec.kv_lora_rank, b)
            proj += (h * qk + h * (spec.qk_nope_dim + v) + h * qk) * b
            if mixer == "dsa":  # indexer query and key (computed without grad: nothing else is saved)
                proj += 0
        else:
            qk = v = spec.head_dim
            proj = 0
            if spec.qk_norm:
                proj += (4 + b) * (h * qk + spec.kv_heads * qk)
            if spec.attn_gate:  # sigmoid(gate) and the attention output it multiplies
                proj += 2 * h * v * b
        if kernel == "sdpa":
            kv = spec.kv_heads if mixer not in ("mla", "dsa") else h
            attn = (h * qk + kv * qk + kv * v + h * v) * b + h * 4
        else:
            # q, k, v repeated to H heads, o_proj input; own output in the accumulation dtype; with a
            # prefix also q regrouped for it and its partial output. lse/merge weights: a few per head.
            attn = (h * qk + h * qk + h * v + h * v) * b + h * v * a + 4 * h * 4
            if kernel == "replay":
                attn += h * qk * b + h * v * a
        return proj + attn
    elif mixer in ("linear", "mamba"):
        return 0
    else:
        raise ValueError(f"unknown mixer kind {mixer!r}")


def _mlp_activation_bytes(spec: ModelSpec, mlp: str, b: int) -> int:
    """SwiGLU: gate, up, act(gate), act*up (4·I·b). MoE: router logits and probabilities (fp32), per chosen
    expert the gathered input, its SwiGLU and output, plus the shared expert."""
    if mlp == "dense":
        return 4 * spec.intermediate * b
    elif mlp == "moe":
        routed = spec.experts_per_token * (4 * spec.moe_intermediate + 2 * spec.hidden) * b
        return routed + 4 * spec.shared_intermediate * b + 2 * spec.num_experts * 4
    elif mlp == "none":
        return 0
    else:
        raise ValueError(f"unknown mlp kind {mlp!r}")


def _layer_per_token(spec: ModelSpec, layer: int, b: int, a: int, kernel: str) -> int:
    """Saved bytes per token of decoder layer `layer` (norms + mixer + MLP) without its recurrent scan."""
    mlp = spec.mlps[layer]
    norms = _norm(spec.hidden, b) * (2 if mlp != "none" else 1)
    return norms + _mixer_activation_bytes(spec, spec.mixers[layer], b, a, kernel) + _mlp_activation_bytes(
        spec, mlp, b)


def layer_activation_bytes(spec: ModelSpec, layer: int, b: int, a: int, kernel: str, tokens: int,
                           batch: int = 1) -> int:
    """Saved bytes of decoder layer `layer` in a forward with grad over `batch` rows of `tokens` tokens."""
    rec = recurrent_bytes(spec, spec.mixers[layer], tokens, b, batch, cached=kernel != "sdpa")
    return batch * tokens * _layer_per_token(spec, layer, b, a, kernel) + rec.saved


def model_activation_bytes(spec: ModelSpec, b: int, a: int, kernel: str, tokens: int, batch: int = 1) -> int:
    """Saved bytes of the whole decoder (every layer, the final norm, the input ids) for `batch` x `tokens`."""
    layers = sum(_layer_per_token(spec, i, b, a, kernel) for i in range(spec.num_layers))
    rec = sum(recurrent_bytes(spec, spec.mixers[i], tokens, b, batch, cached=kernel != "sdpa").saved
              for i in _recurrent_layers(spec))
    return batch * tokens * (layers + _norm(spec.hidden, b) + 8) + rec


def chunk_activation_bytes(spec: ModelSpec, b: int, a: int, kernel: str, tokens: int) -> int:
    """Saved bytes of a prompt-backward chunk recompute of `tokens` tokens: the forward stops once the last layer's
    state is produced, so that layer contributes its input norm (and q/k-norm, computed before its K), and a
    recurrent last layer its scan too (its state comes out of it), without the gated norm and output projection."""
    last_layer = spec.num_layers - 1
    layers = sum(_layer_per_token(spec, i, b, a, kernel) for i in range(last_layer))
    last = _norm(spec.hidden, b)
    if spec.qk_norm and spec.mixers[-1] in ("attention", "sliding"):
        last += (4 + b) * (spec.heads + spec.kv_heads) * spec.head_dim
    rec = sum(recurrent_bytes(spec, spec.mixers[i], tokens, b).saved for i in _recurrent_layers(spec)
              if i < last_layer)
    tail = recurrent_bytes(spec, spec.mixers[-1], tokens, b)
    return tokens * (layers + last + 8) + rec + tail.saved - tail.tail


def _mlp_width(spec: ModelSpec, layer: int) -> int:
    """Intermediate width whose gradients a checkpointed layer's backward holds at once (Mamba2 layers: the mixer's
    inner width). MoE: one expert's width, not the k routed experts' sum: measured on b1-qwen3-next (2 of 8 experts
    of 352 + a shared one of 352), the backward of a checkpointed MoE layer adds 5.5-6.2 KB per token beyond its saved
    tensors (11.2 and 12.1 MiB at T = 2048 behind a linear and an attention mixer), where (4·I + 2·d)·b gives 7.7 KB
    with one expert's I and 18.9 KB with k·I_moe + I_shared (the standard plan's checkpointed step was then +16%)."""
    mlp = spec.mlps[layer]
    if mlp == "dense":
        return spec.intermediate
    elif mlp == "moe":
        return max(spec.moe_intermediate, spec.shared_intermediate)
    else:
        return spec.mamba_heads * spec.mamba_head_dim


def segment_activation_bytes(spec: ModelSpec, b: int, a: int, kernel: str, tokens: int, batch: int,
                             checkpoint_layers: bool, scans: bool = True) -> int:
    """Saved bytes of a forward with grad over `batch` rows of `tokens` tokens, plus the recurrent layers' backward
    transient; with per-layer activation checkpointing (`checkpointing.py`) each layer's input (d·b) is kept, plus,
    while one layer is recomputed and backpropagated, that layer's activations and its backward's gradient buffers:
    the MLP's four intermediate gradients and two of the hidden size, (4·I + 2·d)·b (measured on deep-smollm2:
    28.2-28.9 KB per token where this gives 28.5), or a recurrent scan's (`RecurrentBytes.backward`).

    scans=False (with checkpointing): without the recurrent scans' recompute terms (their saved tensors and backward
    transient): what the log-prob's transient (or the standard plans' logits), which ends before the first layer is
    recomputed, coincides with."""
    cached = kernel != "sdpa"
    recs = [recurrent_bytes(spec, spec.mixers[i], tokens, b, batch, cached) for i in _recurrent_layers(spec)]
    backward = max((r.backward for r in recs), default=0)
    if not checkpoint_layers:
        return model_activation_bytes(spec, b, a, kernel, tokens, batch) + backward
    n = batch * tokens
    if scans:
        largest = max(layer_activation_bytes(spec, i, b, a, kernel, tokens, batch) for i in range(spec.num_layers))
    else:
        largest = max(n * _layer_per_token(spec, i, b, a, kernel) for i in range(spec.num_layers))
        backward = 0
    backward = max(backward, max(n * (4 * _mlp_width(spec, i) + 2 * spec.hidden) * b for i in range(spec.num_layers)))
    return n * (spec.num_layers * spec.hidden * b + _norm(spec.hidden, b) + 8) + largest + backward


def standard_checkpointed_step_bytes(spec: ModelSpec, b: int, a: int, tokens: int, seqs: int, logits: int,
                                     grads: int, steady: bool) -> int:
    """Step bytes of a standard plan's forward+backward over `seqs` rows of `tokens` tokens with per-layer
    checkpointing, as the phases follow each other (located with torch.profiler's allocation events on deep-smollm2,
    P = 1024-4096, standard and standard_batched; tests/test_planner.py validates the sum at P = 2048 and 16,384):

    * logits: every layer's input (n·d·b) + the log-probs' tensors;
    * layers, backward from the last: a layer recomputed holds its saved activations plus one gradient buffer of
      its MLP width (a recurrent layer: its scan's backward transient), while the output projection's (V, d)
      gradient waits. With gradients resident (`steady`), the waiting (V, d) gradient is only extra when tied (it
      waits for the embedding's). Without, parameter gradients appear layer by layer as the layer inputs are freed:
      the high point is at the first layer (all inputs) or the last (one input, every other gradient);
    * the embedding's backward: its dense (V, d) gradient (tied: plus the waiting one and their sum)."""
    n = seqs * tokens
    inputs = n * (spec.hidden * b + 8)  # one layer's input (+ the int64 ids)
    every_input = n * (spec.num_layers * spec.hidden * b + _norm(spec.hidden, b) + 8)
    layer = 0
    for i in range(spec.num_layers):
        rec = recurrent_bytes(spec, spec.mixers[i], tokens, b, seqs, cached=False)
        saved = n * _layer_per_token(spec, i, b, a, "sdpa") + rec.saved
        # The MLP's backward, past the saved tensors it frees: one gradient of its width (dense, profiled); an MoE
        # layer's routing adds more (measured 5.5-6.2 KB per token on b1-qwen3-next: see `_mlp_width`).
        width = _mlp_width(spec, i)
        buffer = n * (4 * width + 2 * spec.hidden) * b if spec.mlps[i] == "moe" else n * width * b
        layer = max(layer, saved + max(buffer, rec.backward))
    vd = spec.vocab * spec.hidden * b
    if steady:
        layers = grads + every_input + (vd if spec.tied else 0) + layer
        embedding = grads + (3 if spec.tied else 1) * vd
        return max(grads + every_input + logits, layers, embedding)
    produced = grads - (0 if spec.tied else vd)  # every gradient but the embedding's (tied: the waiting one)
    layers = max(every_input + vd, inputs + produced) + layer
    embedding = grads + (2 if spec.tied else 0) * vd
    return max(every_input + logits, layers, embedding)


def recurrent_capture_bytes(spec: ModelSpec, positions: int, b: int, chunk: int) -> int:
    """Transient of capturing one chunk through the recurrent layers: the largest layer's no-grad transient + the
    residual stream (4·d·b per token, as the attention formula counts it)."""
    layers = _recurrent_layers(spec)
    if not layers:
        return 0
    tokens = min(chunk, positions)
    recs = [recurrent_bytes(spec, spec.mixers[i], tokens, b) for i in layers]
    return tokens * 4 * spec.hidden * b + max(r.nograd for r in recs)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanInputs:
    """One planning question. Sizes in tokens; gpu_memory and reserve in bytes (reserve None: the device's
    default, CPU_RUNTIME_BYTES on cpu, DEFAULT_CUDA_RESERVE on cuda)."""

    prompt_tokens: int
    response_tokens: int
    group_size: int
    dtype: str = "bf16"
    gpus: int = 1
    gpu_memory: int = 96 * 10**9
    cp: int = 1
    shard: bool = True  # FSDP/ZeRO-3 over the GPUs (when gpus > 1)
    micro_batch: int = 1
    chunk_size: int = 2048
    token_chunk: int = 1024
    optimizer: str = "adamw"
    device: str = "cuda"
    reserve: int | None = None
    checkpoint_layers: bool = False  # per-layer activation checkpointing (backward_group(checkpoint="layers"))
    offload_state: bool = False  # prompt state + its gradient in host memory (backward_group(offload_state=True))


@dataclass
class PlanEstimate:
    """Per-GPU bytes of one plan: `components` (sizes), `phases` (resident + each phase's transient), `total`
    (the peak: resident + the largest phase, plus the optimizer), `step_bytes` (what a bench measures: the
    peak above the loaded weights, no optimizer state)."""

    plan: str
    components: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    total_bytes: int
    step_bytes: int
    fits: bool
    prompt_state_bytes: int
    within_positions: bool = True  # P + R <= the model's max_position_embeddings (LongStraw refuses beyond it)


def _bytes_of(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def estimate(spec: ModelSpec, inp: PlanInputs, plan: str) -> PlanEstimate:
    """Predict one plan's per-GPU memory for `inp` (see the module docstring for the composition)."""
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}: choose one of {', '.join(PLANS)}")
    b = _bytes_of(inp.dtype)
    a = max(4, b)  # accumulation dtype of attention merges and optimizer moments
    p, r, g = inp.prompt_tokens, inp.response_tokens, inp.group_size
    shards = inp.gpus if inp.shard and inp.gpus > 1 else 1
    n, d, v = spec.params, spec.hidden, spec.vocab

    weights = n * b // shards
    grads = n * b // shards
    if inp.optimizer == "adamw":
        optimizer = n * (8 + (4 if b < 4 else 0)) // shards  # exp_avg, exp_avg_sq (+ fp32 master weights)
    elif inp.optimizer == "none":
        optimizer = 0
    else:
        raise ValueError(f"unknown optimizer {inp.optimizer!r}: adamw or none")
    gathered = (2 * max(spec.max_layer_params, v * d) + spec.max_layer_params) * b if shards > 1 else 0
    if inp.reserve is not None:
        runtime = inp.reserve
    elif inp.device == "cpu":
        runtime = CPU_RUNTIME_BYTES
    else:
        runtime = DEFAULT_CUDA_RESERVE

    comp: dict[str, int] = {"weights": weights, "gradients": grads, "optimizer": optimizer}
    phases: dict[str, int] = {}
    resident = weights + optimizer + runtime + gathered
    if plan in ("detach", "exact"):
        exact = plan == "exact"
        parts = state_parts(spec, p - 1, b, inp.chunk_size, exact)
        state, state_grad = parts.per_rank(inp.cp)
        if inp.offload_state:
            comp["state_in_host_memory"] = state + state_grad
            if inp.checkpoint_layers:
                # One layer's copy of its attention part is on the device at a time (replay: the whole prefix;
                # prompt backward: the chunks before chunk j, plus chunk j's gradient of every layer brought over),
                # plus the recurrent states being read. Measured by counting the live copies within 5%
                # (tests/state/test_offload.py).
                layer = math.ceil(parts.largest_layer / inp.cp)
                copies = layer
                if exact:
                    f = min(inp.chunk_size, p - 1) / (p - 1)
                    copies = max(layer, math.ceil(layer * (1 - f) + parts.attention_grad / inp.cp * f))
                state = copies + (parts.recurrent_grad if exact else parts.recurrent)  # one boundary's worth
                state_grad = (layer + parts.recurrent_grad) if exact else 0
            # else: every layer's copy is saved for the backward: the whole state is on the device anyway
        k = min(inp.micro_batch, g)
        tokens = k * r
        acts = segment_activation_bytes(spec, b, a, "replay", r, k, inp.checkpoint_layers)
        # With checkpointing, the recurrent layers' recompute terms come after the log-prob's transient has ended
        # (measured: a checkpointed replay of b1-mamba2 / b1-qwen3-next peaks in its log-prob, every layer holding
        # its input only): they count against it with a max (attention-only models: acts).
        during_logprob = (segment_activation_bytes(spec, b, a, "replay", r, k, True, scans=False)
                          if inp.checkpoint_layers else acts)
        c = min(inp.token_chunk, tokens)
        logprob = max(2 * c * v * b, c * v * b + v * d * b)
        dsa = any(m == "dsa" for m in spec.mixers)
        indexer = DSA_SCORE_ROWS * math.ceil(p / inp.cp) * 4 if dsa else 0
        steady = math.ceil(g / k) > 1  # gradients already resident while the next micro-batch runs
        # The backward's tail: the embedding's dense (V, d) gradient; with tied embeddings the output projection's
        # (V, d) gradient also waits in autograd's input buffer until it is summed with it.
        tail = (2 if spec.tied else 1) * v * d * b
        forward_backward = max(during_logprob + logprob + indexer, acts)
        if steady:
            replay = grads + max(forward_backward, tail)
        else:
            replay = max(forward_backward, grads + (v * d * b if spec.tied else 0))
        chunk = min(inp.chunk_size, p - 1)
        capture = chunk * (3 * spec.intermediate + 4 * d + 2 * spec.heads * max(spec.head_dim, 1)) * b
        # Recurrent layers: the chunk's transient through their scans.
        recurrent = [recurrent_bytes(spec, spec.mixers[i], chunk, b) for i in _recurrent_layers(spec)]
        if recurrent:
            capture = max(capture, recurrent_capture_bytes(spec, p - 1, b, inp.chunk_size))
        phases["capture"] = resident + state + capture
        phases["replay"] = resident + state + state_grad + replay
        comp.update(prompt_state=state, state_gradients=state_grad, replay_activations=acts,
                    logprob_chunk=logprob)
        if dsa:
            comp["indexer_scores"] = indexer
        if exact:
            kernel = "replay" if p - 1 > inp.chunk_size else "own"
            chunk_acts = (segment_activation_bytes(spec, b, a, kernel, chunk, 1, True) if inp.checkpoint_layers
                          else chunk_activation_bytes(spec, b, a, kernel, chunk)
                          + max((x.backward for x in recurrent), default=0))
            # backward transient of one layer (gradients of its MLP input/intermediate), measured ~ (I + d)·b
            if not inp.checkpoint_layers:  # (with checkpointing the layer's backward buffers are counted above)
                chunk_acts += chunk * (spec.intermediate + d) * b
            phases["prompt_backward"] = resident + grads + state + state_grad + chunk_acts
            comp["prompt_backward_chunk"] = chunk_acts
        prompt_state = state
    else:
        seqs = g if plan == "standard_batched" else 1
        acts = segment_activation_bytes(spec, b, a, "sdpa", p + r, seqs, inp.checkpoint_layers)
        logits = 3 * seqs * r * v * b  # log-softmax output, its gradient, the logits' gradient
        steady = plan == "standard" and g > 1  # gradients already resident while the next sequence runs
        if inp.checkpoint_layers:
            step = standard_checkpointed_step_bytes(spec, b, a, p + r, seqs, logits, grads, steady)
        else:
            step = (grads + max(acts + logits, acts)) if steady else max(acts + logits, acts, grads)
        phases["forward_backward"] = resident + step
        comp.update(prompt_state=0, sequence_activations=acts, logits=logits)
        prompt_state = 0
    if gathered:
        comp["fsdp_gathered"] = gathered
    comp["runtime"] = runtime
    peak_phase = max(phases, key=lambda k: phases[k])
    total = phases[peak_phase]
    within = not spec.max_positions or p + r <= spec.max_positions
    return PlanEstimate(
        plan=plan, components=comp, phases=phases, peak_phase=peak_phase, total_bytes=total,
        step_bytes=total - weights - optimizer, fits=within and total <= inp.gpu_memory,
        prompt_state_bytes=prompt_state, within_positions=within,
    )


def largest_prompt(spec: ModelSpec, inp: PlanInputs, plan: str, limit: int = 2**34) -> int | None:
    """The largest prompt length (tokens) for which `plan` fits `inp.gpu_memory`; None if not even 2 fits,
    `limit` if everything up to it fits. Memory grows monotonically with P, so a binary search suffices."""
    from dataclasses import replace

    def fits(p: int) -> bool:
        return estimate(spec, replace(inp, prompt_tokens=p), plan).fits

    if not fits(2):
        return None
    if fits(limit):
        return limit
    lo, hi = 2, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_all(spec: ModelSpec, inp: PlanInputs, plans: tuple[str, ...] = PLANS) -> dict[str, object]:
    """Every plan's estimate and largest fitting prompt, as the JSON document `longstraw plan --json` prints."""
    out: dict[str, object] = {}
    for plan in plans:
        est = estimate(spec, inp, plan)
        entry = asdict(est)
        entry["largest_prompt_tokens"] = largest_prompt(spec, inp, plan)
        out[plan] = entry
    return {
        "model": {
            "name": spec.name, "model_type": spec.model_type, "params": spec.params,
            "expert_params": spec.expert_params, "layers": spec.num_layers, "max_positions": spec.max_positions,
            "layer_kinds": {k: spec.mixers.count(k) for k in dict.fromkeys(spec.mixers)},
        },
        "inputs": asdict(inp),
        "plans": out,
    }


# ---------------------------------------------------------------- CLI


_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'96GB' (10^9), '24GiB' (2^30), '512MiB', '1.5TB' -> bytes. A unit is required."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {text!r}: write a number and a unit, e.g. 96GB, 80GiB, 512MiB "
            f"(units: {', '.join(u if u.endswith('B') and len(u) < 4 else u[:-2] + 'iB' for u in _UNITS)})"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def add_arguments(parser) -> None:
    """Options of `longstraw plan`."""
    parser.add_argument("--model", required=True,
                        help=f"built-in ({', '.join(BUILTIN_NAMES)}), a preset (b1-llama, ...), a directory with "
                             "config.json, a config.json file, or a hub id")
    parser.add_argument("--prompt-tokens", type=positive_int, required=True, help="P")
    parser.add_argument("--response-tokens", type=positive_int, required=True, help="R (every response)")
    parser.add_argument("--group-size", type=positive_int, required=True, help="G")
    parser.add_argument("--gpus", type=positive_int, default=1, help="GPUs sharing the step (default 1)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 96GB or 80GiB (default 80GB)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="parameter dtype")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree of the prompt state")
    parser.add_argument("--no-shard", action="store_true", help="replicate weights/grads/optimizer (no FSDP)")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="responses replayed at once")
    parser.add_argument("--chunk-size", type=positive_int, default=2048, help="prompt chunk (capture/backward)")
    parser.add_argument("--token-chunk", type=positive_int, default=1024, help="rows per log-prob block")
    parser.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                        help="adamw: fp32 moments (+ fp32 master weights for bf16/fp16)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default) or cpu: sets the runtime reserve")
    parser.add_argument("--reserve", help="per-GPU bytes outside the tensors (default 2GiB on cuda, 20MiB on cpu)")
    parser.add_argument("--checkpoint-layers", action="store_true",
                        help="per-layer activation checkpointing (keeps each layer's input only; "
                             "backward_group(checkpoint='layers'), longstraw train --checkpoint-layers)")
    parser.add_argument("--offload-state", action="store_true",
                        help="prompt state and its gradient in host memory, one layer's part on the GPU at a time "
                             "(backward_group(offload_state=True)); saves GPU memory with --checkpoint-layers")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (shared by the planner's and the benchmarks' command lines)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def inputs_from_args(args) -> PlanInputs:
    """PlanInputs from parsed options; raises ValueError on a bad size or combination."""
    if args.prompt_tokens < 2:
        raise ValueError("--prompt-tokens must be >= 2 (detach/exact capture all but the last prompt token)")
    if args.cp > args.gpus:
        raise ValueError(f"--cp {args.cp} needs at least as many GPUs (--gpus {args.gpus})")
    return PlanInputs(
        prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens, group_size=args.group_size,
        dtype=args.dtype, gpus=args.gpus, gpu_memory=parse_size(args.gpu_memory), cp=args.cp,
        shard=not args.no_shard, micro_batch=args.micro_batch, chunk_size=args.chunk_size,
        token_chunk=args.token_chunk, optimizer=args.optimizer, device=args.device,
        reserve=parse_size(args.reserve) if args.reserve else None, checkpoint_layers=args.checkpoint_layers,
        offload_state=args.offload_state,
    )


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def format_plan(document: dict[str, object]) -> str:
    """The table: one row per component, one column per plan (GB = 10^9 bytes), then total, fits, largest P."""
    plans: dict[str, dict] = document["plans"]  # type: ignore[assignment]
    inp: dict = document["inputs"]  # type: ignore[assignment]
    model: dict = document["model"]  # type: ignore[assignment]
    names = list(plans)
    rows: list[str] = []
    for est in plans.values():
        for key in est["components"]:
            if key not in rows:
                rows.append(key)
    width = max(len(r) for r in rows + ["largest prompt (tokens)"]) + 1
    head = f"{'per GPU, GB':<{width}}" + "".join(f"{n:>18}" for n in names)
    lines = [
        f"{model['name']} ({model['model_type']}, {model['params'] / 1e9:.2f}B params, layers "
        + ", ".join(f"{k}x{v}" for k, v in model["layer_kinds"].items()) + ")",
        f"P={inp['prompt_tokens']} R={inp['response_tokens']} G={inp['group_size']} {inp['dtype']}, "
        f"{inp['gpus']} GPU(s) x {inp['gpu_memory'] / 1e9:.1f} GB, cp={inp['cp']}, "
        f"{'FSDP/ZeRO-3' if inp['shard'] and inp['gpus'] > 1 else 'no sharding'}, micro-batch "
        f"{inp['micro_batch']}, chunk {inp['chunk_size']}"
        + (", per-layer activation checkpointing" if inp["checkpoint_layers"] else "")
        + (", prompt state offloaded to host memory" if inp.get("offload_state") else ""),
        head, "-" * len(head),
    ]
    for key in rows:
        lines.append(f"{key:<{width}}" + "".join(f"{_gb(plans[n]['components'].get(key)):>18}" for n in names))
    lines.append("-" * len(head))
    lines.append(f"{'peak (total)':<{width}}" + "".join(f"{_gb(plans[n]['total_bytes']):>18}" for n in names))
    lines.append(f"{'peak phase':<{width}}" + "".join(f"{plans[n]['peak_phase']:>18}" for n in names))
    lines.append(f"{'fits':<{width}}" + "".join(f"{'yes' if plans[n]['fits'] else 'NO':>18}" for n in names))
    positions = inp["prompt_tokens"] + inp["response_tokens"]
    if model.get("max_positions") and positions > model["max_positions"]:
        lines.append(f"NO for every plan: P + R = {positions:,} positions exceeds the model's max_position_embeddings "
                     f"({model['max_positions']:,}), which LongStraw refuses; use a longer-context model")
    largest = [plans[n]["largest_prompt_tokens"] for n in names]
    lines.append(f"{'largest prompt (tokens)':<{width}}"
                 + "".join(f"{('none' if x is None else f'{x:,}'):>18}" for x in largest))
    lines.append("peak = weights + optimizer + runtime (+ FSDP gather) + the largest phase; a phase holds the "
                 "resident gradients/state plus its own transient rows")
    return "\n".join(lines)


def run_from_args(args) -> int:
    """Entry point of `longstraw plan`; bad input goes to the parser's error (exit 2)."""
    try:
        inp = inputs_from_args(args)
        spec = spec_from_config(load_config(args.model), name=args.model)
    except ValueError as err:
        args.fail(str(err))
    document = plan_all(spec, inp)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_plan(document))
    return 0
