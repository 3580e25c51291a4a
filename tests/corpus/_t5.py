"""T5's relative-position buckets (transformers' T5Attention._relative_position_bucket), in the
project's words, as torch code that works both on index tensors and under the tracer: half the
buckets exact small distances, the rest log-spaced up to max_distance; bidirectional splits them
by sign; unidirectional keeps only keys before the query."""
import math

import torch


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def bias_table(num_buckets, H, device, seed=5):
    """A learned [num_buckets, H] bias (seeded: the corpus has no weights)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_buckets, H, generator=g).to(device)
