"""Admission by verification: a model is admitted when a tiny float64 copy of its *own* config (`tiny.tiny_config`)
passes LongStraw's parity checks against transformers, run here in seconds (docs/architectures.md: what, and why).

`verify(config)` measures, on a 37-token prompt and responses of 5, 1 and 9 tokens in 13-token chunks, the replayed
log-probs (`exact`) and the sampled log-probs against transformers' full forward, the `exact` gradient against the
`standard` gradient, and the prompt state's bytes. Tolerance: 1e-9 where every op runs in float64; 1e-6 where
transformers computes some op in a lower precision inside the float64 model (seen by watching every op's dtype).
`verdict_for(config)` runs it once per (model type, config hash, transformers version, hash of the deciding code) and
caches the verdict in memory and under `$LONGSTRAW_CACHE/verdicts/` (unset or empty: ~/.cache/longstraw)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longstraw.admission.tiny import build_tiny_model, tiny_config
from longstraw.engine.hf.composite import COMPOSITE_MODEL_TYPES, language_config

PROMPT, RESPONSES, CHUNK = 37, (5, 1, 9), 13
EXACT_TOL = 1e-9  # every op in float64: another order of the same sums
FP32_TOL = 1e-6  # some op computes in float32 inside the float64 model

# Fields of a saved config that say nothing about the computation.
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
             "_attn_implementation_autoset", "_commit_hash", "auto_map", "output_hidden_states",
             "output_attentions", "return_dict", "_experts_implementation")


def composite_refusal(config: Any) -> str | None:
    """Why LongStraw does not run a composite config's text tower (it runs `COMPOSITE_MODEL_TYPES`' only), or None."""
    text = language_config(config)
    if text is config or config.model_type in COMPOSITE_MODEL_TYPES:
        return None
    return (f"{config.model_type} wraps a {text.model_type} text model: LongStraw runs the text tower of "
            f"{', '.join(COMPOSITE_MODEL_TYPES)} checkpoints only; load the text model itself (its causal-LM class)")


def config_hash(config: Any) -> str:
    """sha256 (16 hex digits) of the config's fields that shape the computation."""
    data = {k: v for k, v in language_config(config).to_dict().items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Verdict:
    """What `verify` measured on a tiny copy of one config.

    kind: "exact" (every op in float64, within 1e-9), "exact within float32 kernels" (within 1e-6, where
    transformers computes some op in float32 inside the float64 model) or "refused". Errors: max |Δ log-prob| of the
    replay and of sampling against the full forward, and ||g_exact − g_standard|| / ||g_standard||."""

    model_type: str
    config_hash: str
    kind: str
    tolerance: float
    logprob_error: float | None = None
    sampled_error: float | None = None
    gradient_error: float | None = None
    float32_ops: tuple[str, ...] = ()
    state_bytes: int | None = None
    planner_bytes: int | None = None
    first_difference: str | None = None
    reason: str | None = None
    layers: str = ""
    recurrent: bool = False  # some layer keeps a conv or recurrent state (its one-token kernels write in place)
    seconds: float = 0.0
    transformers_version: str = transformers.__version__
    longstraw_version: str = ""
    cache_file: str | None = None  # the cache file it was read from or written to (`verdict_for`); not saved in it
    from_cache: bool = False  # read from `cache_file` rather than measured in this process; not saved either

    @property
    def admitted(self) -> bool:
        return self.kind != "refused"

    def summary(self) -> str:
        def show(x: float | None) -> str:
            return "-" if x is None else f"{x:.2e}"

        planner = ("not modelled" if self.planner_bytes is None
                   else "equal" if self.planner_bytes == self.state_bytes
                   else f"{self.planner_bytes} vs {self.state_bytes} measured")
        lines = [
            f"{self.model_type} (config {self.config_hash}, transformers {self.transformers_version}): {self.kind}",
            f"  tiny copy: {self.layers}",
            f"  replayed log-probs vs full forward: {show(self.logprob_error)} (max abs)",
            f"  sampled log-probs vs full forward:  {show(self.sampled_error)} (max abs)",
            f"  exact vs standard gradient:         {show(self.gradient_error)} (relative)",
            f"  tolerance: {self.tolerance:g}" + (f" (float32 inside: {', '.join(self.float32_ops[:4])})"
                                                  if self.float32_ops else " (every op in float64)"),
            f"  prompt state bytes vs planner: {planner}",
            f"  took {self.seconds:.1f} s",
        ]
        if self.first_difference:
            lines.append(f"  first layer that differs: {self.first_difference}")
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        return "\n".join(lines)

    def refusal(self) -> str:
        """The error message of a refused model."""
        errors = (("replayed log-probs", self.logprob_error), ("sampled log-probs", self.sampled_error),
                  ("gradient", self.gradient_error))
        measured = [f"{name} off by {value:.3g}" for name, value in errors
                    if value is not None and not value <= self.tolerance]
        where = f"; first layer that differs: {self.first_difference}" if self.first_difference else ""
        cached = (f" (verdict {'read from' if self.from_cache else 'cached in'} {self.cache_file}: delete it to "
                  "measure again)" if self.cache_file else "")
        what = ", ".join(measured) if measured else (self.reason or "the check failed")
        return (f"architecture {self.model_type!r} is refused: a tiny float64 copy of this config does not match "
                f"transformers' own forward ({what}, tolerance {self.tolerance:g}){where}. "
                f"`longstraw check` on the model prints the full check{cached}")


class _LowPrecisionOps(TorchDispatchMode):
    """Records the ops whose floating-point output is not float64 (run inside a float64 model)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.ops.add(str(func.overloadpacket.__name__))
        return out


def _layer_outputs(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """Each decoder layer's output hidden states while `run()` executes (the first call of each layer)."""
    from longstraw.engine.activation_checkpointing import decoder_layers

    seen: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            seen.setdefault(i, h.detach())
        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(decoder_layers(model))]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in sorted(seen)]


def _first_difference(model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor, tol: float) -> str | None:
    """The first decoder layer whose output over [last prompt token ; response] differs between a replay from the
    captured prompt state and the full forward, with the difference and the layer's kind."""
    from longstraw.engine.activation_checkpointing import decoder_layers
    from longstraw.engine.hf.segment import run_segment
    from longstraw.engine.state.capture import capture_prompt

    ids = torch.cat([prompt, response])
    t = response.numel() + 1
    full = _layer_outputs(model, lambda: model(input_ids=ids[None], use_cache=False))
    state = capture_prompt(model, prompt[:-1], chunk_size=CHUNK)
    replay = _layer_outputs(model, lambda: run_segment(model, ids[prompt.numel() - 1:][None], prompt.numel() - 1,
                                                        state.fork()))
    types = list(getattr(language_config(model.config), "layer_types", None) or [])
    layers = decoder_layers(model)
    for i, (f, r) in enumerate(zip(full, replay)):
        diff = float((f[..., -t:, :] - r[..., -t:, :]).abs().max()) if f.shape[-1] == r.shape[-1] else math.inf
        if not diff <= tol:
            kind = types[i] if i < len(types) else type(layers[i]).__name__
            return f"layer {i} ({kind}, {type(layers[i]).__name__}): {diff:.3g}"
    return ("no decoder layer: every layer's output matches, so the difference comes after the decoder (a factor or "
            "soft-cap the model applies to its logits)")


def _sampled_error(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    from longstraw.engine.sampling import SamplingConfig, sample_group

    rollout = sample_group(model, prompt, 2, SamplingConfig(max_new_tokens=5), seed=1, chunk_size=CHUNK)
    worst = 0.0
    p = prompt.numel()
    for response, logp in zip(rollout.responses, rollout.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0]
        ref = torch.log_softmax(logits[p - 1:-1].double(), -1).gather(-1, response[:, None]).squeeze(-1)
        worst = max(worst, float((ref - logp).abs().max()))
    return worst


def _state_facts(model: torch.nn.Module) -> tuple[int, bool]:
    """(prompt-state bytes for 40 positions in 16-token chunks, whether some layer keeps a conv or recurrent state)."""
    from longstraw.engine.state.capture import capture_prompt

    state = capture_prompt(model, torch.arange(40), chunk_size=16)
    recurrent = any(t is not None for part in ("conv", "recurrent") for layer in state.parts.get(part, [])
                    for t in layer)
    return state.nbytes(), recurrent


def _plans(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor],
           advantages: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(flat parameter gradient, per-response log-probs) of the `standard` and `exact` plans of the group's one-level
    tree under dapo's loss (on-policy: the policy gradient -Σ_i A_i Σ_t ∇log p(o_it) / Σ_i |o_i|; any loss with a
    nonzero gradient serves a parity check). The walks are run directly: this check is what admission calls."""
    from longstraw.engine.group import Group
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.options import BackwardOptions
    from longstraw.engine.precision import accumulation_dtype
    from longstraw.engine.tree.build import group_tree
    from longstraw.engine.tree.loss import TreeLoss
    from longstraw.engine.tree.plans import Walk, exact, standard
    from longstraw.models.architecture import hf
    from longstraw.plan import EXACT, STANDARD

    weight = hf(model).get_input_embeddings().weight
    out = []
    for plan in (STANDARD, EXACT):
        model.zero_grad(set_to_none=True)
        options = BackwardOptions(plan=plan, chunk_size=CHUNK, loss=LossConfig("dapo"))
        tree = group_tree(Group(prompt, responses, advantages))
        loss = TreeLoss(tree, options.loss, weight.device, accumulation_dtype(weight.dtype))
        walk = Walk(model=model, tree=tree, loss=loss, options=options)
        standard(walk, batched=False) if plan is STANDARD else exact(walk)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        out.append((torch.cat([g.flatten() for g in grads]), loss.logprobs))
    model.zero_grad(set_to_none=True)
    return out


def _longstraw_version() -> str:
    try:
        return importlib.metadata.version("longstraw")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def _where(err: BaseException) -> str:
    """`Type: message` and the innermost frame of the traceback, for a crash inside the check."""
    frames = traceback.extract_tb(err.__traceback__)
    frame = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    first = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {first[:300]}{frame}"


def verify(config: Any, seed: int = 0) -> Verdict:
    """Build the tiny float64 copy of `config` and measure it (see the module's docstring)."""
    from longstraw.models.architecture import hf

    started = time.perf_counter()
    model_type = str(language_config(config).model_type)
    base: dict[str, Any] = {"model_type": model_type, "config_hash": config_hash(config),
                            "longstraw_version": _longstraw_version()}

    def refused(reason: str, **measured: Any) -> Verdict:
        return Verdict(kind="refused", tolerance=measured.pop("tolerance", EXACT_TOL), reason=reason,
                       seconds=time.perf_counter() - started, **base, **measured)

    why = composite_refusal(config)
    if why is not None:
        return refused(why)
    try:
        tiny, layers = tiny_config(config)
        model = build_tiny_model(tiny, seed)
    except Exception as err:
        return refused(f"no tiny copy could be built: {_where(err)}")
    vocab = int(hf(model).get_input_embeddings().num_embeddings)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in RESPONSES]
    advantages = torch.randn(len(responses), generator=gen, dtype=torch.float64)
    measured: dict[str, Any] = {"layers": layers}
    try:
        watch = _LowPrecisionOps()
        with watch, torch.no_grad():
            model(input_ids=torch.cat([prompt, responses[0]])[None], use_cache=False)
        low = tuple(sorted(watch.ops))
        tol = FP32_TOL if low else EXACT_TOL
        measured.update(float32_ops=low, tolerance=tol)
        (g_std, lp_std), (g_exact, lp_exact) = _plans(model, prompt, responses, advantages)
        measured["logprob_error"] = max(float((a - b).abs().max()) for a, b in zip(lp_std, lp_exact))
        norm = float(g_std.norm())
        measured["gradient_error"] = float((g_exact - g_std).norm()) / norm if norm > 0 else math.inf
        measured["sampled_error"] = _sampled_error(model, prompt)
        measured["state_bytes"], measured["recurrent"] = _state_facts(model)
    except Exception as err:
        first = None
        try:
            first = _first_difference(model, prompt, responses[2], measured.get("tolerance", EXACT_TOL))
        except Exception:
            pass
        return refused(f"the check crashed: {_where(err)}", first_difference=first, **measured)
    if all(measured[key] <= tol for key in ("logprob_error", "gradient_error", "sampled_error")):
        kind = "exact within float32 kernels" if low else "exact"
        return Verdict(kind=kind, seconds=time.perf_counter() - started, **base, **measured)
    try:
        first = _first_difference(model, prompt, responses[2], tol)
    except Exception as err:
        first = f"not found ({_where(err)})"
    return refused("the replay does not match transformers' forward", first_difference=first, **measured)


_VERDICTS: dict[str, Verdict] = {}
# The code a verdict depends on (a change re-checks every cached config): the check, the engine, the model handling.
_DECIDING_CODE = ("admission", "engine", "models")
KINDS = ("exact", "exact within float32 kernels", "refused")


def cache_dir() -> Path:
    from longstraw.models.gguf_files import cache_root

    return cache_root() / "verdicts"


def source_hash(root: Path, folders: tuple[str, ...]) -> str:
    """sha256 (12 hex digits) of the names and contents of the .py files under `root`/`folders`."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@functools.cache
def code_hash() -> str:
    """`source_hash` of the code that decides a verdict (`_DECIDING_CODE` of this package)."""
    return source_hash(Path(__file__).resolve().parent.parent, _DECIDING_CODE)


def verdict_key(config: Any) -> str:
    model_type = str(language_config(config).model_type)
    return f"{model_type}-{config_hash(config)}-tf{transformers.__version__}-code{code_hash()}"


def _read_verdict(path: Path, config: Any) -> Verdict | None:
    """The verdict a cache file holds, or None (with a warning naming the file) when it is unreadable or holds
    something else (a verdict of another config included)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not a verdict object")
        data["float32_ops"] = tuple(data.get("float32_ops", ()))
        data.pop("cache_file", None)
        verdict = Verdict(**data)
        expected = (str(language_config(config).model_type), config_hash(config))
        if verdict.kind not in KINDS or (verdict.model_type, verdict.config_hash) != expected:
            raise ValueError(f"kind {verdict.kind!r} of {verdict.model_type} {verdict.config_hash}, not a verdict of "
                             f"{expected[0]} {expected[1]}")
    except (OSError, ValueError, TypeError) as err:  # a cut, hand-edited, unreadable or foreign file
        warnings.warn(f"verdict cache {path}: not a readable verdict ({type(err).__name__}: {err}); measuring again",
                      stacklevel=3)
        return None
    return dataclasses.replace(verdict, cache_file=str(path), from_cache=True)


def verdict_for(config: Any, refresh: bool = False) -> Verdict:
    """The verdict for `config`, from memory, from the disk cache, or measured now (and then cached); `refresh`:
    measured now whatever is cached. `Verdict.cache_file`: the file read or written, `from_cache`: whether read."""
    key = verdict_key(config)
    if key in _VERDICTS and not refresh:
        return _VERDICTS[key]
    path = cache_dir() / f"{key}.json"
    verdict = _read_verdict(path, config) if path.exists() and not refresh else None
    if verdict is None:
        verdict = verify(config)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            saved = {k: v for k, v in dataclasses.asdict(verdict).items() if k not in ("cache_file", "from_cache")}
            tmp.write_text(json.dumps(saved, indent=1))
            tmp.replace(path)
            verdict = dataclasses.replace(verdict, cache_file=str(path))
        except OSError:
            pass  # a read-only cache: the verdict stays in memory
    _VERDICTS[key] = verdict
    return verdict
