"""CPU checks of cubridge.runtime.autograd: what attention() cannot do is refused up front with a
LaunchError that names the argument and the fix (the GPU path is tested in tests/gpu/test_bwd.py)."""
from __future__ import annotations

import pytest
import torch

from cubridge.errors import LaunchError
from cubridge.runtime.autograd import attention, check_supported


def _qkv(d=64, dtype=torch.float16, shape=None):
    shape = shape or (1, 2, 8, d)
    return [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("qkv, match", [
    (_qkv(dtype=torch.float32), "dtype torch.float32; supported: float16, bfloat16"),
    (_qkv(d=96), "head dim 96 is not supported"),
    (_qkv(shape=(2, 8, 64)), r"expected \[B, H, N, D\]"),
    (_qkv(), "on cpu; the kernels run on CUDA"),
])
def test_refuses_what_it_cannot_do(qkv, match):
    with pytest.raises(LaunchError, match=match) as e:
        attention(*qkv, causal=True)
    assert "cubridge.runtime.autograd.attention" in str(e.value)


def test_refuses_non_finite_scale():
    with pytest.raises(LaunchError, match="scale=nan"):
        check_supported(*_qkv(), float("nan"))


def test_non_tensor_input():
    q, k, _ = _qkv()
    with pytest.raises(LaunchError, match="v: expected a torch.Tensor"):
        attention(q, k, [1.0])
