"""The math helpers of lowered kernels (cexpr.PRELUDE, and experiments/patches/knobs/sigmoid_fma.cuh
that experiments splice in), run on the GPU over dense input ranges and the special values, against
float64: cuir_sigmoid_fma must hold its stated relative error (2^-13) everywhere, give exactly 0 at
-inf and 1 at +inf, and stay within a bf16 P's rounding of the MUFU sigmoid it stands in for."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cubridge.lower.cexpr import PRELUDE
from cubridge.runtime.build import compile_cubin
from cubridge.runtime.launch import LoadedKernel, arg_i32, arg_ptr, device_arch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SIGMOID_FMA = (Path(__file__).resolve().parents[2] / "experiments" / "patches" / "knobs" / "sigmoid_fma.cuh").read_text()

SOURCE = PRELUDE + SIGMOID_FMA + """
extern "C" __global__ void sigmoids(const float* x, float* fma_out, float* mufu_out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { fma_out[i] = cuir_sigmoid_fma(x[i]); mufu_out[i] = cuir_sigmoid(x[i]); }
}
"""


def _run(x: torch.Tensor):
    dev = torch.cuda.current_device()
    cubin = compile_cubin(SOURCE, arch=device_arch(dev), compiler="nvrtc").cubin
    kern = LoadedKernel(cubin, "sigmoids", dev)
    fma_out, mufu_out = torch.empty_like(x), torch.empty_like(x)
    n = x.numel()
    kern.launch(((n + 255) // 256, 1, 1), (256, 1, 1), 0, [arg_ptr(x), arg_ptr(fma_out), arg_ptr(mufu_out), arg_i32(n)])
    torch.cuda.synchronize()
    return fma_out.double().cpu(), mufu_out.double().cpu()


def test_sigmoid_fma_relative_error_everywhere():
    x = torch.cat([torch.linspace(-100, 100, 2_000_001), torch.linspace(-0.01, 0.01, 100_001),
                   torch.tensor([-80.0, -79.999, 80.0, 87.0, -87.0, 1e30, -1e30])]).cuda()
    got, _ = _run(x)
    xd = x.double().cpu()
    want = torch.sigmoid(xd)
    live = xd > -80          # below: flushed to 0 (true value < 1.9e-35)
    rel = ((got[live] - want[live]).abs() / want[live]).max().item()
    assert rel < 2.0 ** -13, f"relative error {rel:.3e} (2^{np.log2(rel):.2f})"
    assert (got[~live] == 0).all() and (got[~live] >= 0).all()


def test_sigmoid_fma_special_values():
    x = torch.tensor([float("-inf"), float("inf"), 0.0, -0.0], device="cuda")
    got, mufu = _run(x)
    assert got[0] == 0.0 and mufu[0] == 0.0, "a masked score (-inf) must give exactly 0"
    assert abs(got[1] - 1.0) < 2.0 ** -13 and abs(got[2] - 0.5) < 2.0 ** -14 and abs(got[3] - 0.5) < 2.0 ** -14


def test_sigmoid_fma_agrees_with_mufu_sigmoid():
    x = torch.linspace(-30, 30, 600_001, device="cuda")
    got, mufu = _run(x)
    # both land on the same bf16 P up to one rounding step
    assert ((got - mufu).abs() <= 2.0 ** -8 * torch.maximum(got, mufu) + 1e-6).all()
