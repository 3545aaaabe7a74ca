"""Full-distribution distillation losses (GKD): per-position divergences between the student's and the
teacher's next-token distributions over the whole vocabulary (or the teacher's top-k plus a tail bucket).

Legend: T = packed tokens, V = vocabulary, K = distribution width (V, or k + 1 with a tail bucket),
M = target (loss-mask) positions. Rows are target-aligned like every per-token tensor: row t is the
distribution token t was drawn from (log p(. | tokens before t)); rows off the loss mask are ignored.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), eq. 1-2; the names and the ``beta`` convention follow TRL's ``GKDTrainer``
(``generalized_jsd_loss``)::

    full_forward_kl  D_t = sum_v p_T(v) (log p_T(v) - log p_S(v))          (KL(teacher || student))
    full_reverse_kl  D_t = sum_v p_S(v) (log p_S(v) - log p_T(v))          (KL(student || teacher))
    jsd              m = beta p_T + (1 - beta) p_S,
                     D_t = beta KL(p_T || m) + (1 - beta) KL(p_S || m)      (beta=0: forward KL, 1: reverse KL,
                                                                            as TRL special-cases them)

The gradient flows through the student's whole distribution (no sampling estimate); the teacher's
rows are constants. ``teacher_top_k``: the teacher's k most likely tokens keep their log-probs and
every other token is merged into one tail bucket (1 - the top-k mass), for both models, so each row is
a (k+1)-way distribution; it equals the full divergence when the tail is empty, and the teacher's
storage is [T, k] log-probs + ids instead of [T, V].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardforge.core.registry import Registry
from shardforge.engine.batching import PackedBatch
from shardforge.engine.objectives.aggregation import aggregation_coefficients
from shardforge.engine.objectives.loss_fns import PPOActorLossFn
from shardforge.engine.objectives.on_policy import OnPolicyActorLossFn

__all__ = [
    "DIVERGENCES",
    "TEACHER_LOGPROBS",
    "TEACHER_TOKEN_IDS",
    "DistributionDistillTerm",
    "Divergence",
    "FullDistillActorLossFn",
    "FullDistillOnPolicyActorLossFn",
    "bucketed_logprobs",
    "full_forward_kl",
    "full_reverse_kl",
    "generalized_jsd",
]

TEACHER_LOGPROBS = "teacher_logprobs"
"""[T, K] float32 teacher log-probs per target position (K = V, or k with ``TEACHER_TOKEN_IDS``); 0 off the mask."""
TEACHER_TOKEN_IDS = "teacher_token_ids"
"""[T, k] int64 the teacher's top-k token ids per position (absent: rows cover the whole vocabulary)."""

Divergence = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(student log-probs [M, K], teacher log-probs [M, K], beta) -> [M] per-position divergence."""

DIVERGENCES: Registry[Divergence] = Registry("distillation divergence")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """[M] KL(p || q) of rows of (finite) log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@DIVERGENCES.register("full_forward_kl")
def full_forward_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.0) -> torch.Tensor:
    """KL(teacher || student) per position (GKD's / TRL's beta = 0; mass-covering)."""
    return _kl(teacher, student)


@DIVERGENCES.register("full_reverse_kl")
def full_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """KL(student || teacher) per position, exact over the vocabulary (GKD's / TRL's beta = 1; mode-seeking)."""
    return _kl(student, teacher)


@DIVERGENCES.register("jsd")
def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD: beta KL(T || m) + (1 - beta) KL(S || m), m = beta T + (1 - beta) S (TRL's convention)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta={beta} must be in [0, 1] (0: forward KL, 1: reverse KL, in between: JSD)")
    if beta == 0.0:  # the mixture is the student: TRL special-cases the ends to the two KLs
        return full_forward_kl(student, teacher, 0.0)
    if beta == 1.0:
        return full_reverse_kl(student, teacher, 1.0)
    weights = torch.tensor([1.0 - beta, beta], dtype=student.dtype, device=student.device).log()
    mixture = torch.logsumexp(torch.stack([student + weights[0], teacher + weights[1]]), dim=0)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def _log1m_sum_exp(log_p: torch.Tensor) -> torch.Tensor:
    """[M, 1] log(1 - sum exp(log_p)) (the tail bucket's log-mass), floored at a tiny mass for stability."""
    mass = log_p.exp().sum(-1, keepdim=True)
    return torch.log(torch.clamp(1.0 - mass, min=torch.finfo(log_p.dtype).tiny))


def bucketed_logprobs(
    student_MV: torch.Tensor, teacher_Mk: torch.Tensor, ids_Mk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, k+1] student and teacher log-probs over the teacher's top-k tokens plus one tail bucket."""
    student_Mk = student_MV.gather(-1, ids_Mk)
    student = torch.cat([student_Mk, _log1m_sum_exp(student_Mk)], dim=-1)
    teacher = torch.cat([teacher_Mk, _log1m_sum_exp(teacher_Mk)], dim=-1)
    return student, teacher


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributionDistillTerm:
    """``coef * sum_t c_t D_t`` over a micro-batch's targets (c_t: the actor's aggregation coefficients)."""

    divergence: str
    """A name in `DIVERGENCES` (or ``package.module:function``)."""
    beta: float = 0.5
    """jsd only: the teacher's weight in the mixture."""
    coef: float = 1.0
    """Weight of the term in the loss (``distill_coef``)."""

    def __call__(
        self, distribution_TV: torch.Tensor, mb: PackedBatch, coefficients_T: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed, differentiable loss term; detached stats: ``distill_divergence`` sum over targets)."""
        mask = mb.loss_mask != 0
        if TEACHER_LOGPROBS not in mb.extras:
            if bool(mask.any()):
                raise KeyError(f"the micro-batch has targets but no extra {TEACHER_LOGPROBS!r} (the teacher's rows)")
            return distribution_TV.sum() * 0.0, {}
        student = distribution_TV[mask].float()
        teacher = mb.extras[TEACHER_LOGPROBS].to(student.device)[mask].float()
        if TEACHER_TOKEN_IDS in mb.extras:
            student, teacher = bucketed_logprobs(
                student, teacher, mb.extras[TEACHER_TOKEN_IDS].to(student.device)[mask]
            )
        elif student.shape != teacher.shape:
            raise ValueError(
                f"student rows {tuple(student.shape)} and teacher rows {tuple(teacher.shape)} differ: both must cover "
                "the same vocabulary (or set the teacher's top-k token ids)"
            )
        per_position = DIVERGENCES.get(self.divergence)(student, teacher, self.beta)
        loss = self.coef * (coefficients_T[mask].to(per_position.dtype) * per_position).sum()
        return loss + distribution_TV.sum() * 0.0, {"distill_divergence": per_position.detach().double().sum().cpu()}


class _WithDistributionTerm:
    """Adds a `DistributionDistillTerm` to a PPO actor loss (task-reward advantages, KL, entropy bonus)."""

    wants_distribution = True
    """The engine passes the student's [T, V] log-probs (differentiable) as ``distribution=``."""
    term: DistributionDistillTerm

    def __call__(
        self,
        logprobs: torch.Tensor,
        mb: PackedBatch,
        entropy: torch.Tensor | None = None,
        distribution: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if distribution is None:
            raise ValueError("a full-distribution distillation loss needs the engine's distribution= argument")
        actor = super().__call__(logprobs, mb, entropy)  # type: ignore[misc]
        config = self.config  # type: ignore[attr-defined]
        coefficients = aggregation_coefficients(mb.loss_mask, mb.cu_seqlens, config.aggregation, config.norm_length)
        term, stats = self.term(distribution, mb, coefficients)
        if stats:
            self._stats.append(stats)  # type: ignore[attr-defined]
        return actor + term  # type: ignore[no-any-return]


class FullDistillActorLossFn(_WithDistributionTerm, PPOActorLossFn):
    """`PPOActorLossFn` (recomputed old log-probs) plus the full-distribution distillation term."""

    def __init__(self, config: object, term: DistributionDistillTerm) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.term = term


class FullDistillOnPolicyActorLossFn(_WithDistributionTerm, OnPolicyActorLossFn):
    """`OnPolicyActorLossFn` (old log-probs from the training forward) plus the distillation term."""

    def __init__(self, config: object, correction: object, term: DistributionDistillTerm) -> None:
        super().__init__(config, correction)  # type: ignore[arg-type]
        self.term = term
