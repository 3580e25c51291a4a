"""Sigmoid attention, causal: p = sigmoid(score + bias), bias = -log(N); no row normalisation.

PARAMS: bias; None means -log(Nk) (N = the number of keys a row ranges over).
"""
import math

import torch

from cubridge.spec import Hooks, Normalization

PARAMS = {"bias": None}


def sigmoid_bias(Nk, bias):
    return -math.log(Nk) if bias is None else bias


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def hooks(Nq, Nk, Hq, Hkv, device, bias=None):
    return Hooks(mask_mod=causal_mask,
                 normalization=Normalization("sigmoid", bias=sigmoid_bias(Nk, bias)))


def reference(q, k, v, bias=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_idx = torch.arange(q.shape[2], device=q.device)[:, None]
    kv_idx = torch.arange(k.shape[2], device=q.device)[None, :]
    p = torch.sigmoid(scores + sigmoid_bias(k.shape[2], bias))
    return p.masked_fill(~(kv_idx <= q_idx), 0.0) @ v
