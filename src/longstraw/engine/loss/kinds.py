"""One typed entry per loss (`LOSS_KINDS`): its normaliser, its per-token policy term, its ratio's default level, its
default clip widths and the parameters it owns. `config.LossConfig` validates options against the entry, and `terms`
picks the normalisation and the policy term by the entry's properties (the definitions: the package docstring)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Normaliser(enum.Enum):
    """What a response's summed per-token terms are divided by (G responses, |o_i| loss tokens each)."""

    PER_SEQUENCE = "1/(G|o_i|)"  # grpo, gspo, sapo: the mean over each response's tokens, then over responses
    MAX_TOKENS = "1/(G L_max)"  # dr_grpo: L_max = `max_tokens` or the group's longest response
    TOKENS = "1/Σ|o_i|"  # dapo, cispo, vespo, nll: the group's token count, or `token_normalizer`
    PER_GROUP = "1/G"  # luspo: each response weighted by its length


class PolicyTerm(enum.Enum):
    """The policy part of a token's term (docs/design.md §5)."""

    CLIPPED = "clipped"  # −min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A), two-sided with `delta`
    CAPPED_WEIGHT = "capped_weight"  # cispo: −sg(min(ρ, ε_max)) A logp
    SIGMOID_GATE = "sigmoid_gate"  # sapo: −(4/τ) σ(τ (ρ − 1)) A
    SEQUENCE_WEIGHT = "sequence_weight"  # vespo: −φ_i A logp, φ_i read from the whole sequence
    NLL = "nll"  # −logp


@dataclass(frozen=True)
class Parameter:
    """A parameter a loss owns (e.g. sapo's temperatures): its option name, default, and whether it must be > 0."""

    name: str
    default: float
    positive: bool


@dataclass(frozen=True)
class LossKind:
    """One loss's properties.

    clip: the default clip widths (ε_low, ε_high) of a clipped loss, which takes epsilon, epsilon_low, epsilon_high
    and delta; None for the others. cap: the default upper cap of the importance weight (cispo's ε_max, set by
    epsilon_high alone). Neither: the loss takes no clip widths. sequence_ratio: its ratio is the sequence's s_i unless
    `sequence_ratio` says otherwise; per_token_twin: the loss a per-token ratio would make of it, refused (gspo's
    grpo). token_level: a token's term reads its own log-prob only when the ratio is per token (vespo's weight reads
    the whole sequence). supervised: a loss of gold responses (no advantage, ratio, clip or KL term)."""

    name: str
    normaliser: Normaliser
    term: PolicyTerm
    sequence_ratio: bool = False
    per_token_twin: str | None = None
    token_level: bool = True
    clip: tuple[float, float] | None = None
    cap: float | None = None
    own: tuple[Parameter, ...] = ()
    supervised: bool = False

    @property
    def clipped(self) -> bool:
        """Whether the policy term is the clipped m_{i,t} (which takes the clip widths and `delta`)."""
        return self.term is PolicyTerm.CLIPPED

    @property
    def token_normalised(self) -> bool:
        """Whether the loss divides by a token count, which `token_normalizer` replaces."""
        return self.normaliser is Normaliser.TOKENS


_GSPO_CLIP = (3e-4, 4e-4)  # the GSPO paper's
_ENTRIES = (
    LossKind("grpo", Normaliser.PER_SEQUENCE, PolicyTerm.CLIPPED, clip=(0.2, 0.2)),
    LossKind("dr_grpo", Normaliser.MAX_TOKENS, PolicyTerm.CLIPPED, clip=(0.2, 0.2)),
    LossKind("dapo", Normaliser.TOKENS, PolicyTerm.CLIPPED, clip=(0.2, 0.28)),  # clip-higher
    LossKind("gspo", Normaliser.PER_SEQUENCE, PolicyTerm.CLIPPED, sequence_ratio=True, per_token_twin="grpo",
             clip=_GSPO_CLIP),
    LossKind("luspo", Normaliser.PER_GROUP, PolicyTerm.CLIPPED, sequence_ratio=True, clip=_GSPO_CLIP),
    LossKind("cispo", Normaliser.TOKENS, PolicyTerm.CAPPED_WEIGHT, cap=5.0),  # ScaleRL's recommended cap
    LossKind("sapo", Normaliser.PER_SEQUENCE, PolicyTerm.SIGMOID_GATE,  # the SAPO paper's temperatures
             own=(Parameter("sapo_temperature_pos", 1.0, True), Parameter("sapo_temperature_neg", 1.05, True))),
    LossKind("vespo", Normaliser.TOKENS, PolicyTerm.SEQUENCE_WEIGHT, token_level=False,  # the VESPO paper's shape
             own=(Parameter("vespo_k_pos", 2.0, False), Parameter("vespo_lambda_pos", 3.0, False),
                  Parameter("vespo_k_neg", 3.0, False), Parameter("vespo_lambda_neg", 2.0, False))),
    LossKind("nll", Normaliser.TOKENS, PolicyTerm.NLL, supervised=True),
)
LOSS_KINDS: dict[str, LossKind] = {entry.name: entry for entry in _ENTRIES}
OWN_PARAMETERS: dict[str, tuple[str, Parameter]] = {  # every loss-owned option: (its owner, the parameter)
    p.name: (entry.name, p) for entry in _ENTRIES for p in entry.own}
