"""Held-out comparison of drafts with the target on the teacher's eval responses (teacher-forced).

One forward per model per batch yields the response-position logits [N, V] of each (a chunk of N at a time); TVD to the
target at T = 1 is what acceptance measures (alpha = 1 - E[TVD]), and argmax agreement between two
drafts says how often their greedy proposals coincide.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftsmith.distill import losses
from draftsmith.distill.train import response_logits


def compare_drafts(
    target, drafts: Sequence, rows: list[dict], batch_size: int, max_seq_len: int, device: torch.device | str = "cpu", chunk: int = 0
) -> dict[str, list[float] | float]:
    """Per-token TVD of each draft to the target, and the argmax agreement of the first two drafts; the logits
    are made `chunk` positions at a time (0: a batch's all at once)."""
    tvd_sums, agree, count = [0.0] * len(drafts), 0, 0
    for _, (target_logits, *draft_logits) in response_logits([target, *drafts], rows, batch_size, max_seq_len, device, chunk):
        for j, logits in enumerate(draft_logits):
            tvd_sums[j] += losses.tvd(*losses.full(logits, target_logits, 1.0)).sum().item()
        if len(draft_logits) > 1:
            agree += (draft_logits[0].argmax(-1) == draft_logits[1].argmax(-1)).sum().item()
        count += len(target_logits)
    if not count:
        raise ValueError("no held-out response tokens to compare on")
    return {"tvd": [s / count for s in tvd_sums], "greedy_agreement": agree / count, "tokens": count}
