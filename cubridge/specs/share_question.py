"""Shared-question attention (one question, several answers packed in one sequence), softmax.

The sequence of N = Nk tokens is a question (the first N // 4 tokens), then `answers` answers of
equal length (N - question) // answers, the last one taking any remainder. Causal, and an answer
token sees the question and its own answer only; question tokens see the question causally.
The layout lives in a captured per-token segment-id tensor: 0 = question, 1..answers = answers.
Query positions at or beyond Nk (only when Nq > Nk) continue the last answer.

PARAMS: question = length of the question; None means Nk // 4 (a value above Nk means the whole
sequence is question). answers = 3.
"""
import math

import torch

from cubridge.spec import Hooks

PARAMS = {"question": None, "answers": 3}


def segment_ids(positions, Nk, question=None, answers=3):
    """Segment of each position: the number of segment starts at or before it."""
    if (question is not None and question < 0) or answers < 1:
        raise ValueError(f"share_question needs question >= 0 and answers >= 1, "
                         f"got question={question}, answers={answers}")
    # A question longer than the sequence (short test shapes) makes it all question.
    q_len = Nk // 4 if question is None else min(question, Nk)
    a_len = (Nk - q_len) // answers
    starts = q_len + a_len * torch.arange(answers, device=positions.device)
    return (positions[:, None] >= starts[None, :]).sum(-1)


def hooks(Nq, Nk, Hq, Hkv, device, question=None, answers=3):
    segment = segment_ids(torch.arange(max(Nq, Nk), device=device), Nk, question, answers)

    def share_question_mask(b, h, q_idx, kv_idx):
        kv_seg = segment[kv_idx]
        return (kv_idx <= q_idx) & ((kv_seg == 0) | (kv_seg == segment[q_idx]))

    return Hooks(mask_mod=share_question_mask)


def reference(q, k, v, question=None, answers=3):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    Nq, Nk = q.shape[2], k.shape[2]
    q_pos = torch.arange(Nq, device=q.device)
    kv_pos = torch.arange(Nk, device=q.device)
    q_seg = segment_ids(q_pos, Nk, question, answers)[:, None]
    kv_seg = segment_ids(kv_pos, Nk, question, answers)[None, :]
    mask = (kv_pos[None, :] <= q_pos[:, None]) & ((kv_seg == 0) | (kv_seg == q_seg))
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p.masked_fill(~mask, 0.0) @ v
