"""The planner's per-layer byte formulas (docs/design.md §4): the prompt state and the activations autograd saves
(the recurrent scans' from `recurrent`, per layer and per model, a prompt-backward chunk, the segment and
standard-plan checkpointed terms). The package docstring (`longstraw.planner`) says how `estimate` composes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from longstraw.planner.recurrent import _recurrent_layers, recurrent_bytes
from longstraw.planner.spec import ModelSpec


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
    elif mixer == "mamba1":  # conv window over the inner width; SSM state in the scan's dtype (fp32 or wider)
        inner = spec.mamba_heads * spec.mamba_head_dim
        return inner * spec.conv_kernel * b + inner * spec.mamba_state * max(4, b)
    elif mixer == "conv":  # LFM2's short convolution: a window of the last `conv_kernel` inputs, no recurrent state
        return spec.hidden * spec.conv_kernel * b
    elif mixer == "lightning":  # MiniMax: K^T V per head, in the model's dtype (the layer builds it from its values)
        return spec.lin_value_heads * spec.lin_key_dim * spec.lin_value_dim * b
    elif mixer == "cca":  # ZAYA: the q/k convolution's last inputs (query and key heads) and the delayed value
        window = (spec.heads + spec.kv_heads) * spec.head_dim * spec.conv_kernel
        return (window + spec.kv_heads * spec.head_dim // 2) * b
    return 0


# Mixers whose state holds K and V per prompt token (`ModelSpec.layer_kv` where layers differ).
KV_MIXERS = ("attention", "sliding", "chunked", "attention+mamba", "cca")


def layer_kv(spec: ModelSpec, layer: int) -> tuple[int, int]:
    """(key, value) elements per token that attention layer `layer` keeps."""
    if spec.layer_kv:
        return spec.layer_kv[layer]
    return spec.kv_heads * spec.head_dim, spec.kv_heads * (spec.v_head_dim or spec.head_dim)


def _per_token_state_bytes(spec: ModelSpec, layer: int, b: int) -> tuple[int, int]:
    """(bytes per prompt token that carry a gradient, bytes per token that do not) of one layer's state."""
    mixer = spec.mixers[layer]
    if mixer in KV_MIXERS:  # K and V (V's head dim where it differs; the layer's own where layers differ)
        return sum(layer_kv(spec, layer)) * b, 0
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

    def per_rank(self, cp: int, tp: int = 1) -> tuple[int, int]:
        """(state, state gradient) on one of `cp` context-parallel ranks, each of `tp` tensor-parallel ranks holding
        the K/V of 1/tp of the heads (tensor parallelism admits attention-only families: no recurrent part)."""
        return (math.ceil(self.attention / (cp * tp)) + self.recurrent,
                math.ceil(self.attention_grad / (cp * tp)) + self.recurrent_grad)


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
    """(prompt state, its gradient in the exact plan) for `positions` prompt tokens, one sequence. Attention K/V and MLA
    latents grow with P (sliding layers in detach: the chunks reaching into the last W-1 positions); DSA indexer keys
    grow but carry no gradient; recurrent layers hold one state (detach) or one per chunk boundary (exact), and their
    gradient is one state's worth."""
    return state_parts(spec, positions, b, chunk, exact).per_rank(1)


def _norm(width: int, b: int) -> int:
    """RMSNorm's saved tensors per token: fp32 input copy, normalised input, weighted output."""
    return (4 + 2 * b) * width


def _mixer_activation_bytes(spec: ModelSpec, mixer: str, b: int, a: int, kernel: str) -> int:
    """Saved bytes per token of one token mixer. kernel: 'replay' (LongStraw's prefix attention, with a
    prefix), 'own' (prefix attention without a prefix: the first chunk), 'sdpa' (the standard plans).
    Recurrent mixers (gated DeltaNet, Mamba2) pad to their scan chunk and are counted per segment by
    `recurrent_bytes`: here they count 0 (Falcon-H1's parallel attention heads count)."""
    if mixer in ("attention", "sliding", "chunked", "attention+mamba", "cca", "mla", "dsa"):
        # (ZAYA's `cca`: counted as attention; its q/k convolution's inputs and outputs are not counted)
        h = spec.heads
        if mixer in ("mla", "dsa"):
            qk, v = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
            # latent projections: q_a/kv_a outputs normalised, q_b/kv_b outputs, k assembled from nope + rope
            proj = _norm(spec.q_lora_rank, b) + _norm(spec.kv_lora_rank, b)
            # (DSA's indexer query and key are computed without grad: nothing else is saved)
            proj += (h * qk + h * (spec.qk_nope_dim + v) + h * qk) * b
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
    elif mixer == "conv":
        # LFM2's gated short convolution, counted from the code (not measured): the in_proj output (B, C, x: 3·d),
        # B·x with the cached window before it, the conv output and C·conv (the output projection's input)
        return 7 * spec.hidden * b
    elif mixer in ("linear", "mamba", "mamba1", "lightning", "none"):
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
    """Saved bytes per token of decoder layer `layer` (norms + mixer + MLP) without its recurrent scan: one norm in
    front of each of the mixer and the MLP the layer has (Nemotron-H's blocks have one of them)."""
    mixer, mlp = spec.mixers[layer], spec.mlps[layer]
    norms = _norm(spec.hidden, b) * ((mixer != "none") + (mlp != "none"))
    return norms + _mixer_activation_bytes(spec, mixer, b, a, kernel) + _mlp_activation_bytes(spec, mlp, b)


def layer_activation_bytes(spec: ModelSpec, layer: int, b: int, a: int, kernel: str, tokens: int,
                           batch: int = 1) -> int:
    """Saved bytes of decoder layer `layer` in a forward with grad over `batch` rows of `tokens` tokens."""
    rec = recurrent_bytes(spec, spec.mixers[layer], tokens, b, batch, cached=kernel != "sdpa")
    return batch * tokens * _layer_per_token(spec, layer, b, a, kernel) + rec.saved


def model_activation_bytes(spec: ModelSpec, b: int, a: int, kernel: str, tokens: int, batch: int = 1) -> int:
    """Saved bytes of the whole decoder (every layer, the final norm, the input ids) for `batch` x `tokens`."""
    layers = sum(layer_activation_bytes(spec, i, b, a, kernel, tokens, batch) for i in range(spec.num_layers))
    return layers + batch * tokens * (_norm(spec.hidden, b) + 8)


def last_state_layer(spec: ModelSpec) -> int:
    """The last layer that keeps prompt state: where a capture or prompt-backward chunk's forward stops. The last
    layer but in Nemotron-H, whose trailing MLP/MoE blocks (mixer `none`) keep none, and in Gemma-4 with KV-shared
    layers (`layer_kv` (0, 0)), which read an earlier layer's K/V."""
    return max(i for i, mixer in enumerate(spec.mixers)
               if mixer != "none" and not (mixer in KV_MIXERS and layer_kv(spec, layer=i) == (0, 0)))


def chunk_activation_bytes(spec: ModelSpec, b: int, a: int, kernel: str, tokens: int) -> int:
    """Saved bytes of a prompt-backward chunk recompute of `tokens` tokens: the forward stops once the last layer's
    state is produced (`last_state_layer`), so that layer contributes its input norm (and q/k-norm, computed before
    its K), and a recurrent last layer its scan too (its state comes out of it), without the gated norm and output
    projection; the layers after it never run."""
    last_layer = last_state_layer(spec)
    layers = sum(_layer_per_token(spec, i, b, a, kernel) for i in range(last_layer))
    last = _norm(spec.hidden, b)
    if spec.qk_norm and spec.mixers[last_layer] in ("attention", "sliding", "chunked"):
        last += (4 + b) * (spec.heads + spec.kv_heads) * spec.head_dim
    rec = sum(recurrent_bytes(spec, spec.mixers[i], tokens, b).saved for i in _recurrent_layers(spec) if i < last_layer)
    tail = recurrent_bytes(spec, spec.mixers[last_layer], tokens, b)
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
    transient; with per-layer activation checkpointing (`activation_checkpointing`) each layer's input (d·b) is kept,
    plus, while one layer is recomputed and backpropagated, that layer's activations and its backward's gradient
    buffers: the MLP's four intermediate gradients and two of the hidden size, (4·I + 2·d)·b (measured on deep-smollm2:
    28.2-28.9 KB per token where this gives 28.5), or a recurrent scan's (`RecurrentBytes.backward`).

    scans=False (with checkpointing): without the recurrent scans' recompute terms (saved tensors, backward transient):
    what coincides with the log-prob's transient (or the standard plans' logits), over before any layer's recompute."""
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


def _standard_checkpointed_layers(spec: ModelSpec, b: int, a: int, tokens: int, seqs: int) -> tuple[int, int, int]:
    """(one layer's input, every layer's input, the largest layer's recompute) of a standard plan's checkpointed
    forward+backward over `seqs` rows of `tokens` tokens: the terms `standard_checkpointed_step_bytes` composes."""
    n = seqs * tokens
    inputs = n * (spec.hidden * b + 8)  # one layer's input (+ the int64 ids)
    every_input = n * (spec.num_layers * spec.hidden * b + _norm(spec.hidden, b) + 8)
    layer = 0
    for i in range(spec.num_layers):
        rec = recurrent_bytes(spec, spec.mixers[i], tokens, b, seqs, cached=False)
        saved = n * _layer_per_token(spec, i, b, a, "sdpa") + rec.saved
        saved += math_attention_score_bytes(spec, tokens, seqs, b, [i])  # (MLA/DSA: its probabilities + backward)
        # MLP backward past its saved tensors: one gradient of its width (dense, profiled); MoE: more (`_mlp_width`).
        width = _mlp_width(spec, i)
        buffer = n * (4 * width + 2 * spec.hidden) * b if spec.mlps[i] == "moe" else n * width * b
        layer = max(layer, saved + max(buffer, rec.backward))
    return inputs, every_input, layer


def standard_checkpointed_activation_bytes(spec: ModelSpec, b: int, a: int, tokens: int, seqs: int) -> int:
    """The activations of a standard plan's checkpointed step at its layers' high point: every layer's input plus
    the largest layer recomputed with its backward's buffer (the `sequence_activations` row of `longstraw plan`;
    `standard_checkpointed_step_bytes` holds it, with the gradients, at that point)."""
    _, every_input, layer = _standard_checkpointed_layers(spec, b, a, tokens, seqs)
    return every_input + layer


def standard_checkpointed_step_bytes(spec: ModelSpec, b: int, a: int, tokens: int, seqs: int, logits: int,
                                     grads: int, steady: bool) -> int:
    """Step bytes of a standard plan's forward+backward over `seqs` rows of `tokens` tokens with per-layer
    checkpointing, as the phases follow each other (located with torch.profiler's allocation events on deep-smollm2, P =
    1024-4096, standard and standard_batched; tests/planner/test_planner.py validates the sum at P = 2048 and 16,384):

    * logits: every layer's input (n·d·b) + the log-probs' tensors;
    * layers, backward from the last: a layer recomputed holds its saved activations plus one gradient buffer of
      its MLP width (a recurrent layer: its scan's backward transient), while the output projection's (V, d)
      gradient waits. With gradients resident (`steady`), the waiting (V, d) gradient is only extra when tied (it
      waits for the embedding's). Without, parameter gradients appear layer by layer as the layer inputs are freed:
      the high point is at the first layer (all inputs) or the last (one input, every other gradient);
    * the embedding's backward: its dense (V, d) gradient (tied: plus the waiting one and their sum)."""
    inputs, every_input, layer = _standard_checkpointed_layers(spec, b, a, tokens, seqs)
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


# Mixers whose attention takes the masked path (`attention.masked_prefix_attention`): sliding windows, Llama-4's
# attention chunks, MLA latents, DSA selections.
MASKED_MIXERS = ("sliding", "chunked", "mla", "dsa")


def masked_layers(spec: ModelSpec) -> int:
    """Layers whose attention takes the masked path (`MASKED_MIXERS`). It materialises each key part's scores, where
    the fused path streams them."""
    return sum(m in MASKED_MIXERS for m in spec.mixers)


def masked_score_bytes(spec: ModelSpec, a: int, tokens: int, part: int, batch: int, checkpoint_layers: bool,
                       layers: int | None = None) -> int:
    """Score tensors of the masked path in a forward+backward with grad over `batch` rows of `tokens` queries, in the
    accumulation dtype (`a` bytes); `layers`: masked layers whose attention runs (default all; a prompt-backward chunk
    stops at the last layer's state, so a masked last layer never attends there). Located with torch.profiler on
    b1-deepseek-v3 (exact at P = 4096: the peak holds 9 score-sized tensors, 1152 MiB): the own part (tokens x tokens)
    saves its masked scores and probabilities (2 per layer) until the backward reaches the layer; the backward of the
    first layer it reaches holds 5 score-sized tensors of one part (tokens x `part` keys, a prefix part recomputed under
    activation checkpointing, or the own part) — its scores and the gradients of the masked scores, probabilities and
    products — while each layer below still holds its own. With per-layer checkpointing no other layer holds its own
    part. A sliding window does not shrink the parts: a chunk the window touches is scored whole, then masked."""
    m = masked_layers(spec) if layers is None else layers
    if m <= 0:
        return 0
    own = 2 * spec.heads * batch * tokens * tokens * a
    transient = 5 * spec.heads * batch * tokens * max(tokens, part) * a
    return (0 if checkpoint_layers else (m - 1) * own) + transient


def math_attention_score_bytes(spec: ModelSpec, tokens: int, seqs: int, b: int, layers: list[int]) -> int:
    """The standard plans' attention where it materialises its scores (H x T x T per sequence and layer):

    * MLA/DSA layers: their query/key head dim differs from the value's, so torch's SDPA takes its math path on the
      CPU, which saves each layer's probabilities, and the backward of the layer it reaches holds about 1.5 more
      (measured on b1-deepseek-v3, P = 4096, standard_batched G = 2 and 4: n + 1.54 and n + 1.52 such tensors for
      n layers; located with torch.profiler);
    * every attention layer of a family without an SDPA path (`ModelSpec.eager_attention`: gpt-oss, whose sinks
      join the softmax): transformers' eager attention saves each layer's probabilities, and the last layer's
      forward holds two more (its masked scores and the logits with the sinks, beside the probabilities), counted
      from the code: n + 2 (measured on b1-gpt-oss, P = 4096, standard: 6.2)."""
    n = sum(spec.mixers[i] in ("mla", "dsa") for i in layers)
    eager = sum(spec.eager_attention and spec.mixers[i] in ("attention", "sliding", "chunked") for i in layers)
    scores = spec.heads * seqs * tokens * tokens * b
    return (n * scores + 3 * scores // 2 if n else 0) + ((eager + 2) * scores if eager else 0)
