"""The reduced-precision policy: with a bf16 or fp16 model, what runs in fp32.

Weights, activations, the prompt state and the attention kernels' inputs stay in the model's dtype (the memory the
user chose). Where rounding would compound or bias the objective, the computation runs in the *accumulation dtype*,
fp32 for bf16/fp16 (a wider dtype is kept as it is):

* attention: each chunk's output and log-sum-exp, and every log-sum-exp merge of chunks, of prefix and own parts,
  of context-parallel ranks (bf16 would lose ~1% per merge) — `attention.ChunkAttention`, `prefix_attention`,
  `masked_prefix_attention`; the fused ops themselves accumulate in fp32 and return an fp32 log-sum-exp;
* log-probs: logits in fp32 (on CUDA straight from the GEMM's fp32 accumulator), log-sum-exp over the vocabulary
  and the softmax of the backward in fp32 — `logprobs.chunked_logprobs`, the standard plan's log_softmax;
* sampling: logits, filters and the sampled tokens' log-probs in fp32 (`sampling.sample_group`), and those
  log-probs are returned in fp32 (old log-probs rounded to bf16 would put ~1% noise into every ratio);
* the loss: ratios, clipping, KL and the normalisations in fp32, against advantages and old/reference
  log-probs in fp32 (`api.backward_group`, `loss.response_loss`).

Gradients reach the model in its own dtype (what autograd hands each parameter)."""

from __future__ import annotations

import torch

REDUCED = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16, else `dtype` itself (fp32 and fp64 are kept)."""
    return torch.float32 if dtype in REDUCED else dtype


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: a dtype as messages name it."""
    return str(dtype).removeprefix("torch.")


def head_input(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden` in the output projection's dtype, where a family keeps its head in another (Hunyuan-V4's float32
    lm_head beside bfloat16 layers, `_keep_in_fp32_modules_strict`): its forward casts the hidden states so before
    the head, and so do LongStraw's log-prob passes. Differentiable (the cast's backward casts the gradient back)."""
    return hidden if hidden.dtype == weight.dtype else hidden.to(weight.dtype)


def accumulated_product(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h (c, d) @ weight (V, d)^T (+ bias (V,)) -> (c, V) in the accumulation dtype: for bf16/fp16 on CUDA straight
    from the GEMM's fp32 accumulator (torch.mm's out_dtype), elsewhere cast after the product. Plain tensors only
    (`logprobs.accumulated_logits` takes a vocabulary-split weight too)."""
    acc = accumulation_dtype(h.dtype)
    logits = None
    if acc == h.dtype:
        logits = h @ weight.t()
    elif h.is_cuda:
        try:
            logits = torch.mm(h, weight.t(), out_dtype=acc)
        except (RuntimeError, TypeError):  # a torch without out_dtype for this GEMM
            pass
    if logits is None:
        logits = (h @ weight.t()).to(acc)
    if bias is not None:
        logits.add_(bias.to(acc))
    return logits
