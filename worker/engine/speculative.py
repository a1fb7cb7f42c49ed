"""Verification of a speculative draft scored by the target model in one forward pass.

`target_logits[i]` is the target's distribution for the token after prefix + draft[:i], so
n draft tokens come with n + 1 rows; the last row gives the bonus token when all are accepted.

Sampling uses the rejection rule of Leviathan et al. / Chen et al.: accept draft token x with
probability min(1, p(x) / q(x)); on the first rejection draw from normalize(max(0, p - q)) and
stop. Every emitted token is then distributed exactly as the target p. A deterministic draft
(prompt lookup, n-gram) is the case q = one-hot(x): accept with probability p(x), otherwise
draw from p with x removed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from worker.engine.errors import DraftError
from worker.engine.sampler import SamplingParams, target_probs


def verify_greedy(draft_token_ids: Seq[int], target_logits: torch.Tensor) -> list[int]:
    """Longest prefix of the draft that equals the target's argmax, then one target token."""
    best = target_logits.argmax(-1).tolist()
    out: list[int] = []
    for i, token_id in enumerate(draft_token_ids):
        if best[i] != token_id:
            break
        out.append(token_id)
    out.append(best[len(out)])
    return out


def verify_sampled(
    draft_token_ids: Seq[int],
    target_p: torch.Tensor,
    generator: torch.Generator | None,
    draft_q: torch.Tensor | None = None,
) -> list[int]:
    """target_p: [n + 1, vocab] probabilities; draft_q: [n, vocab], None for a one-hot draft."""
    out: list[int] = []
    for i, token_id in enumerate(draft_token_ids):
        p = target_p[i]
        if draft_q is None:
            q = torch.zeros_like(p)
            q[token_id] = 1.0
        else:
            q = draft_q[i]
        q_x = float(q[token_id])
        if q_x <= 0:
            raise DraftError(f"draft token {token_id} at {i} has draft probability 0")
        accept_prob = min(1.0, float(p[token_id]) / q_x)
        if float(torch.rand((), generator=generator)) < accept_prob:
            out.append(token_id)
            continue
        residual = torch.clamp(p - q, min=0)
        total = float(residual.sum())
        # total == 0 means p == q, where acceptance is certain; only round-off lands here.
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_p[len(out)], 1, generator=generator)))
    return out


def verify_draft(
    draft_token_ids: Seq[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_q: torch.Tensor | None = None,
) -> list[int]:
    """Accepted draft prefix + one correction or bonus token (1..n+1 tokens)."""
    if params.is_greedy:
        return verify_greedy(draft_token_ids, target_logits)
    return verify_sampled(draft_token_ids, target_probs(target_logits, params), generator, draft_q)
