"""GRPO-family losses and advantage estimators, as pure tensor functions: `kinds` (one entry per loss and its
properties), `config` (`LossConfig`, one loss and its options, validated when built), `terms` (`response_loss`, the
per-token terms and their normalisation), `advantages` (`compute_advantages`).

Every loss here is a sum over responses of a per-response term once the group's constants are fixed (G, Σ|o_i|, L_max,
or a normaliser the caller passes), so a group replayed one response at a time, k at a time, or all at once gives the
same total: `response_loss` returns the batch's share of the group loss, and the shares add up.

Definitions: docs/design.md §5 (every loss, the supervised `nll`, the KL term, the options that reproduce other
trainers' definitions and verl's clamps); `tests/engine/test_loss.py` transcribes them loop by loop."""
