"""The backward plans as typed values: one frozen `Plan` per plan (standard, standard_batched, detach, exact) with the
properties the planner, the distributed wrappers and the tables branch on, so code asks `plan.captures_state` rather
than comparing names. Imports nothing at load: `longstraw --help` builds its parsers from `choices.PLANS`, made here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Plan:
    """One backward plan and its properties.

    captures_state: encodes the shared prompt once and replays each response from its state (detach, exact).
    exact_gradient: its gradient equals standard GRPO's (standard, standard_batched, exact; detach is biased).
    needs_chunk_boundaries: the prompt backward walks the capture's chunks from their saved boundaries (exact).
    batched: the whole group runs in one padded batch (standard_batched).
    supports_*: the features the plan runs with (context parallelism and offload need a prompt state; kept capture
    graphs only exist for the exact prompt backward).
    peak_key: the activation kernel the planner's formulas key on (`formulas.segment_activation_bytes`): 'sdpa' for
    the plans that run whole sequences, 'replay' for the ones that replay responses from a prompt state.
    description: one line for --help and tables."""

    name: str
    captures_state: bool
    exact_gradient: bool
    peak_key: str
    description: str
    needs_chunk_boundaries: bool = False
    batched: bool = False
    supports_context_parallel: bool = False
    supports_tensor_parallel: bool = True
    supports_offload: bool = False
    supports_kept_graphs: bool = False

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            raise TypeError("compare a Plan's properties or Plan values, not names")
        if not isinstance(other, Plan):
            return NotImplemented
        return self.name == other.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name


STANDARD = Plan(
    name="standard", captures_state=False, exact_gradient=True, peak_key="sdpa",
    description="each response as a full prompt+response sequence, one at a time (exact, slow)")
STANDARD_BATCHED = Plan(
    name="standard_batched", captures_state=False, exact_gradient=True, peak_key="sdpa", batched=True,
    description="the whole group in one padded batch, as an unmodified trainer runs it (the baseline)")
DETACH = Plan(
    name="detach", captures_state=True, exact_gradient=False, peak_key="replay", supports_context_parallel=True,
    supports_offload=True, description="prompt encoded once without gradient; responses replayed from its state "
    "(biased gradient)")
EXACT = Plan(
    name="exact", captures_state=True, exact_gradient=True, peak_key="replay", needs_chunk_boundaries=True,
    supports_context_parallel=True, supports_offload=True, supports_kept_graphs=True,
    description="prompt encoded once; responses replayed, then the prompt's backward chunk by chunk (exact)")

PLANS: dict[str, Plan] = {plan.name: plan for plan in (STANDARD, STANDARD_BATCHED, DETACH, EXACT)}
# How tables, plots and the planner's document list them: the baseline the others are measured against first.
PLANS_BASELINE_FIRST: tuple[Plan, ...] = (STANDARD_BATCHED, *(p for p in PLANS.values() if p is not STANDARD_BATCHED))


def plan_named(name: str | Plan) -> Plan:
    """The Plan called `name` (a Plan is returned as is); ValueError naming the valid ones for an unknown name."""
    if isinstance(name, Plan):
        return name
    if name in PLANS:
        return PLANS[name]
    import difflib

    # `choices.did_you_mean`'s hint, spelled here: importing choices (whose PLANS come from here) would be a cycle.
    close = difflib.get_close_matches(str(name), list(PLANS), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}{hint}")
