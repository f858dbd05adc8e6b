"""GRPO-family losses and advantage estimators, as pure tensor functions: `kinds` (one entry per loss and its
properties), `config` (`LossConfig`, one loss and its options, validated when built), `terms` (`response_loss`, the
per-token terms and their normalisation), `advantages` (`compute_advantages`).

Every loss here is a sum over responses of a per-response term once the group's constants are fixed
(G, Σ|o_i|, L_max, or a normaliser the caller passes), so a group replayed one response at a time, k at a time, or
all at once gives the same total: `response_loss` returns the batch's share of the group loss, and the shares add
up.

Definitions (docs/design.md §5), with per-token log-probs logp_{i,t}, log-ratio r_{i,t} = logp − old where `old`
defaults to logp.detach() (on-policy: ratio 1 but its gradient is that of logp), and the importance ratio ρ: per
token, ρ_{i,t} = exp(r_{i,t}), or per sequence, s_i = exp((1/|o_i|) Σ_t r_{i,t}) spread over the response's tokens
(gspo and luspo by default; `sequence_ratio` chooses). m_{i,t} = min(ρ A_i, clip(ρ, 1−ε_low, 1+ε_high) A_i):

* ``grpo``:    L = −(1/G) Σ_i (1/|o_i|) Σ_t m_{i,t}
* ``dr_grpo``: L = −(1/(G·L_max)) Σ_i Σ_t m_{i,t}            (L_max = `max_tokens`, default max_i |o_i|)
* ``dapo``:    L = −(1/Σ_i|o_i|) Σ_i Σ_t m_{i,t}              (clip-higher: ε_low 0.2, ε_high 0.28)
* ``gspo``:    grpo with the sequence ratio: L = −(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)
               (ε_low 3e-4, ε_high 4e-4, the GSPO paper's values)
* ``luspo``:   gspo with each response weighted by its length: L = −(1/G) Σ_i |o_i| min(s_i A_i, clip(s_i) A_i),
               i.e. −(1/G) Σ_i Σ_t m_{i,t}; GSPO's clip widths
* ``cispo``:   L = −(1/Σ_i|o_i|) Σ_i Σ_t sg(min(ρ, ε_max)) A_i logp_{i,t}: the importance weight, capped at
               ε_max = `epsilon_high` (the cap itself, not 1 + ε; default 5.0) and detached (sg), times the
               log-prob, so every token keeps a gradient; no lower clip
* ``sapo``:    L = −(1/G) Σ_i (1/|o_i|) Σ_t (4/τ) σ(τ (ρ − 1)) A_i: a sigmoid gate instead of the clip (its slope
               at ρ = 1 is 1, so on-policy it is grpo), τ = `sapo_temperature_pos` (1.0) where A_i > 0, else
               `sapo_temperature_neg` (1.05); no clip widths
* ``vespo``:   L = −(1/Σ_i|o_i|) Σ_i Σ_t φ_i A_i logp_{i,t}, φ_i = sg(e^λ w_i^k e^{−λ w_i}) with w_i the sequence's
               product of token ratios, exp(Σ_t r_{i,t}) (each r_{i,t} clamped to [−20, 20], their sum to
               [ln 1e-8, 20]; a non-finite φ counts 0), and (k, λ) = (`vespo_k_pos`, `vespo_lambda_pos`) = (2, 3)
               where A_i ≥ 0, else (`vespo_k_neg`, `vespo_lambda_neg`) = (3, 2), λ floored at 1e-4; φ(1) = 1;
               no clip widths (the reference implementation's clamps, as TRL has them)

The supervised loss, for a warm start on gold responses (`train/warmup.py`):

* ``nll``:     L = −(1/Σ_i|o_i|) Σ_i Σ_t logp_{i,t}: the mean negative log-likelihood of the loss tokens (|o_i| counts
               a response's loss tokens: observations are masked out), advantages and old log-probs ignored; no
               ratio, clip or KL term (beta, the clip widths and the ratio options are refused). Not one of
               `LOSSES` (the trainer's GRPO losses): `backward_group(..., loss="nll")` and the warm start use it.

With ``beta > 0`` the k3 estimate of KL(π‖π_ref), k3 = exp(ref − logp) − (ref − logp) − 1, is added per token
(times β) with the same normalisation as the policy term.

Options that reproduce other trainers' definitions (TRL's `GRPOTrainer`: `longstraw.integrations.trl` sets them;
docs/trl.md). Each defaults to LongStraw's own definition:

* ``max_tokens``: dr_grpo's L_max (TRL: `max_completion_length`; ours: the group's longest response).
* ``token_normalizer``: the denominator of the token-normalised losses (dapo, cispo, vespo) instead of the group's
  Σ|o_i| (TRL: every completion token of the optimizer step's generation batch, so several groups share one
  denominator; for its bnpo, the micro-batch's tokens).
* ``kl_ratio``: multiply the k3 term by the ratio ρ (token or sequence, as the policy term's) — TRL's
  `use_bias_correction_kl`, its default. Its value is k3 on-policy, its gradient is not: ∇(ρ·k3) = k3·∇ρ + ∇k3.
* ``loss_scale``: the group loss times this factor (TRL averages grpo/dr_grpo/gspo/sapo/luspo over every sequence of
  the optimizer step, N of them: a group of G then weighs G/N).
* ``sequence_ratio``: the ratio's level, True for the sequence's s_i, False for per-token ρ; None is the loss's own
  (sequence for gspo and luspo, token for the others; gspo refuses False: it is grpo). TRL's
  `importance_sampling_level`: with dapo, dr_grpo, cispo or sapo it spreads s_i over the tokens, so a response's
  term is its length times s_i's.
* ``delta``: two-sided clipping (INTELLECT-2) for the clipped losses (grpo, dr_grpo, dapo, gspo, luspo):
  m = min(min(ρ, δ) A, clip(ρ) A), which bounds a negative advantage's term when ρ runs above 1 + ε_high.

Clamps that reproduce verl's numerical-stability clamps (`longstraw.integrations.verl` sets them; docs/verl.md).
Each is a torch.clamp, whose gradient is 0 where the value lies outside the bounds; None (the default) clamps
nothing:

* ``log_ratio_clamp`` = (low, high): the ratio's exponent clamped to [low, high] before the exp, i.e.
  ρ_{i,t} = exp(clamp(r_{i,t})) per token, s_i = exp(clamp((1/|o_i|) Σ_t r_{i,t})) per sequence. low < 0 < high
  (on-policy r = 0 stays 0). verl's policy losses: (−20, 20) per token; its gspo: (−inf, 10) on the sequence's.
* ``kl_clamp`` = (d, c): the k3 term as verl's `kl_penalty` "low_var_kl"/"k3" computes it,
  x = clamp(ref − logp, −d, d), k3 = clamp(exp(x) − x − 1, −c, c); verl's (d, c) = (20, 10). k3 > c from
  ref − logp ≈ 2.6 nats up (for c = 10): there the term and its gradient are constant.
"""
