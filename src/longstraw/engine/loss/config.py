"""`LossConfig`: one loss and its options, checked against the loss's entry (`kinds.LOSS_KINDS`) and completed with
its defaults when it is built. The options' meanings: docs/design.md §5."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from longstraw.engine.loss.kinds import LOSS_KINDS, OWN_PARAMETERS, LossKind

_DEFAULT_CLIP = (0.2, 0.2)  # the clip fields' values for a loss without a lower clip (unused by its terms)


@dataclass(frozen=True, init=False)
class LossConfig:
    """Which loss and its coefficients, validated when built: `LossConfig("dapo", epsilon_high=0.3, beta=0.04)`. An
    option left None takes the loss's own default (dapo's clip-higher widths, gspo's sequence ratio, sapo's temperatures
    ...), so the fields always hold the values the loss computes with. `epsilon` sets both clip sides;
    `epsilon_low`/`epsilon_high` override one (cispo takes `epsilon_high` only, its weight cap; sapo and vespo have no
    clip). An option another loss owns, or one this loss has no use for, is refused unless it equals the value the loss
    would use anyway (so `dataclasses.replace` of a built config works)."""

    kind: str  # the loss's name (its entry: `entry`)
    epsilon_low: float  # lower clip: ratio >= 1 - epsilon_low (unused by cispo, sapo, vespo)
    epsilon_high: float  # upper clip: ratio <= 1 + epsilon_high; cispo: the weight's cap ε_max itself
    beta: float  # KL coefficient (k3 estimator against ref_logprobs)
    max_tokens: int | None  # dr_grpo's L_max; None = longest response in the group
    token_normalizer: float | None  # dapo/cispo/vespo's denominator; None = the group's Σ|o_i|
    kl_ratio: bool  # k3 times the ratio (TRL's use_bias_correction_kl)
    loss_scale: float  # the group loss times this
    sequence_ratio: bool  # the ratio is the sequence's s_i (gspo, luspo) rather than per token
    delta: float | None  # two-sided clipping of the clipped losses: min(ratio, delta) in the unclipped term
    sapo_temperature_pos: float  # sapo's gate temperature where A > 0
    sapo_temperature_neg: float  # ... and where A <= 0
    vespo_k_pos: float  # vespo's power k where A >= 0
    vespo_lambda_pos: float  # vespo's decay λ where A >= 0
    vespo_k_neg: float  # ... where A < 0
    vespo_lambda_neg: float
    log_ratio_clamp: tuple[float, float] | None  # (low, high) on the ratio's exponent; None: unclamped
    kl_clamp: tuple[float, float] | None  # (d, c): ref − logp to ±d before the exp, k3 to ±c; None: unclamped

    def __init__(self, kind: str = "grpo", *, epsilon: float | None = None, epsilon_low: float | None = None,
                 epsilon_high: float | None = None, beta: float = 0.0, max_tokens: int | None = None,
                 token_normalizer: float | None = None, kl_ratio: bool = False, loss_scale: float = 1.0,
                 sequence_ratio: bool | None = None, delta: float | None = None,
                 sapo_temperature_pos: float | None = None, sapo_temperature_neg: float | None = None,
                 vespo_k_pos: float | None = None, vespo_lambda_pos: float | None = None,
                 vespo_k_neg: float | None = None, vespo_lambda_neg: float | None = None,
                 log_ratio_clamp: tuple[float, float] | None = None,
                 kl_clamp: tuple[float, float] | None = None) -> None:
        entry = loss_kind(kind)
        if entry.supervised:
            _refuse_policy_options(entry, epsilon=epsilon, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                                   log_ratio_clamp=log_ratio_clamp, kl_clamp=kl_clamp, beta=beta, kl_ratio=kl_ratio,
                                   sequence_ratio=sequence_ratio)
        low, high = _clip_widths(entry, epsilon, epsilon_low, epsilon_high)
        _check_widths(low, high, float(beta), max_tokens)
        if not isinstance(kl_ratio, bool):
            raise TypeError(f"kl_ratio must be True or False, got {kl_ratio!r}")
        loss_scale = _finite("loss_scale", loss_scale, positive=True)
        values = dict(
            kind=kind, epsilon_low=low, epsilon_high=high, beta=float(beta), max_tokens=max_tokens,
            token_normalizer=_token_normalizer(entry, token_normalizer), kl_ratio=kl_ratio,
            loss_scale=loss_scale, sequence_ratio=_sequence_ratio(entry, sequence_ratio),
            delta=_delta(entry, delta), log_ratio_clamp=_log_ratio_clamp(log_ratio_clamp),
            kl_clamp=_kl_clamp(kl_clamp), **_own_parameters(entry, {
                "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
                "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
                "vespo_lambda_neg": vespo_lambda_neg}))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def entry(self) -> LossKind:
        """The loss's properties (`kinds.LOSS_KINDS`)."""
        return loss_kind(self.kind)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options a caller sets (the constructor's keywords)."""
        return tuple(inspect.signature(cls.__init__).parameters)[1:]


def loss_kind(loss: str) -> LossKind:
    """The entry of the loss named `loss`, refused unless it is one."""
    if loss not in LOSS_KINDS:
        raise ValueError(f"unknown loss {loss!r}: choose one of {', '.join(LOSS_KINDS)}")
    return LOSS_KINDS[loss]


def _names(which: str) -> str:
    """The losses whose entry has the property `which`, comma-separated in the table's order."""
    return ", ".join(name for name, entry in LOSS_KINDS.items() if getattr(entry, which))


def _finite(name: str, value: object, positive: bool) -> float:
    """`value` as a float, refused unless it is a finite number (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _refuse_policy_options(entry: LossKind, **options: object) -> None:
    """A supervised loss has no ratio, clip or KL term: their options must stay unset (or, for clips, the default)."""
    given = [name for name in ("epsilon", "log_ratio_clamp", "kl_clamp") if options[name] is not None]
    given += [name for name, value in (("epsilon_low", options["epsilon_low"]),
                                       ("epsilon_high", options["epsilon_high"]))
              if value is not None and value != _DEFAULT_CLIP[0]]
    given += [name for name, on in (("beta", options["beta"] != 0), ("kl_ratio", options["kl_ratio"] is True),
                                    ("sequence_ratio", options["sequence_ratio"] is True)) if on]
    if given:
        raise ValueError(f"the {entry.name} loss is the mean negative log-likelihood of the loss tokens (no ratio, "
                         f"clip or KL term): leave {', '.join(given)} unset")


def _clip_widths(entry: LossKind, epsilon: float | None, epsilon_low: float | None,
                 epsilon_high: float | None) -> tuple[float, float]:
    """(ε_low, ε_high) from the options and the entry's defaults; a loss without a lower clip refuses epsilon and
    epsilon_low, one without any clip all three (the unused fields' own values, `_DEFAULT_CLIP`, pass)."""
    if entry.clip is not None:
        low, high = entry.clip
        if epsilon is not None:
            low = high = float(epsilon)
        low = float(epsilon_low) if epsilon_low is not None else low
        high = float(epsilon_high) if epsilon_high is not None else high
        return low, high
    unused_low = epsilon_low is not None and epsilon_low != _DEFAULT_CLIP[0]
    if entry.cap is not None:
        if epsilon is not None or unused_low:
            raise ValueError(f"{entry.name} caps its importance weight from above only: set epsilon_high (the cap "
                             "ε_max itself), not epsilon or epsilon_low")
        if epsilon_high is None:
            return _DEFAULT_CLIP[0], entry.cap
        return _DEFAULT_CLIP[0], _finite(f"{entry.name}'s epsilon_high (the weight cap)", epsilon_high, True)
    if epsilon is not None or unused_low or (epsilon_high is not None and epsilon_high != _DEFAULT_CLIP[1]):
        raise ValueError(f"the {entry.name} loss has no clip widths (its weight is smooth): leave epsilon, epsilon_low "
                         "and epsilon_high unset")
    return _DEFAULT_CLIP


def _own_parameters(entry: LossKind, given: dict[str, float | None]) -> dict[str, float]:
    """Every loss-owned parameter (`given`, None: default); refused if set off its default for a loss not owning it."""
    out = {}
    for name, value in given.items():
        owner, parameter = OWN_PARAMETERS[name]
        if owner != entry.name and value is not None and value != parameter.default:
            raise ValueError(f"{name} is a parameter of the {owner} loss, not of {entry.name} (use loss={owner!r})")
        if value is None or owner != entry.name:
            out[name] = parameter.default
        else:
            out[name] = _finite(name, value, parameter.positive)
    return out


def _check_widths(low: float, high: float, beta: float, max_tokens: int | None) -> None:
    """The checks every loss shares: clip widths, beta and dr_grpo's L_max."""
    for name, value in (("epsilon_low", low), ("epsilon_high", high), ("beta", beta)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if low >= 1:
        raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip is 1 - epsilon_low), got {low}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (dr_grpo's L_max), got {max_tokens!r}")


def _token_normalizer(entry: LossKind, value: object) -> float | None:
    if value is None:
        return None
    if not entry.token_normalised:
        raise ValueError(f"token_normalizer is the denominator of {_names('token_normalised')}; the {entry.name} loss "
                         "has none (use loss='dapo')")
    return _finite("token_normalizer", value, positive=True)


def _sequence_ratio(entry: LossKind, value: object) -> bool:
    if value is None:
        return entry.sequence_ratio
    if not isinstance(value, bool):
        raise TypeError(f"sequence_ratio must be True, False or None, got {value!r}")
    if entry.per_token_twin is not None and not value:
        twin = entry.per_token_twin
        raise ValueError(f"{entry.name} is {twin} with the sequence ratio: for per-token ratios use loss={twin!r}")
    return value


def _delta(entry: LossKind, value: object) -> float | None:
    if value is None:
        return None
    if not entry.clipped:
        raise ValueError(f"delta bounds the unclipped ratio of the clipped losses ({_names('clipped')}); the "
                         f"{entry.name} loss has none")
    return _finite("delta", value, positive=True)


def _pair(name: str, value: object, what: str) -> tuple[float, float]:
    """`value` as two floats, refused (naming `what` the pair holds) unless it is a pair of real numbers."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in value):
        raise ValueError(f"{name} must be a pair of numbers {what}, got {value!r}")
    return float(value[0]), float(value[1])


def _log_ratio_clamp(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    low, high = _pair("log_ratio_clamp", value, "(low, high)")
    if not low < 0 < high:
        raise ValueError(f"log_ratio_clamp=(low, high) must have low < 0 < high (the on-policy log-ratio, 0, must "
                         f"pass unchanged; verl's is (-20, 20)), got {value!r}")
    return low, high


def _kl_clamp(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    bound, cap = _pair("kl_clamp", value, "(d, c)")
    if not (bound > 0 and cap > 0):
        raise ValueError(f"kl_clamp=(d, c) must have d > 0 and c > 0 (ref - logp clamped to ±d, k3 to ±c; verl's is "
                         f"(20, 10)), got {value!r}")
    return bound, cap
