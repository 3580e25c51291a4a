"""The fa2 launch's argument packing, checked without a GPU: the ctypes values launch_args gives
match fa2_sm80_fwd's parameter list in kernel.cu (count, order, size of each C type, VariantArgs'
layout), and the kernelParams array the driver launch gets points at exactly those bytes."""
from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch

from cubridge.cuir.parser import parse_file
from cubridge.errors import LaunchError
from cubridge.lower import lower
from cubridge.runtime.driver import pack_params
from cubridge.runtime.fa2_sm80 import KERNEL_PATH, launch_args
from cubridge.runtime.kernels import reference_kernel
from cubridge.runtime.launch import arg_i32, arg_ptr, check_attention_args
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer

C_SIZES = {"int": 4, "float": 4, "VariantArgs": 4}   # the reference's VariantArgs: { int unused; }
SPEC = "relative_pos"   # a captured table (a pointer field) and scalars


def kernel_params(source: str, entry: str) -> list[str]:
    """The parameter types of `entry` in `source`: "ptr", "int", "float" or "VariantArgs"."""
    m = re.search(rf"\b{entry}\s*\(([^)]*)\)\s*\{{", source)
    assert m, f"{entry} not found"
    out = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        out.append("ptr" if "*" in p else "VariantArgs" if "VariantArgs" in p else p.split()[-2])
    return out


def inputs(nq=70, nk=90):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, nq, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, nk, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, nk, 64, generator=g).to(torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 4, nq)
    return q, k, v, out, lse


def lowered_variant(tensors):
    cand = transfer(parse_file(reference_kernel("fa2_sm80").cuir_path()), load_spec(SPEC))
    extra = cand.bind(Nq=tensors[0].shape[2], Nk=tensors[1].shape[2], Hq=4, Hkv=2, B=2)
    return lower(cand.program, "fa2_sm80").args(extra, "cpu")


@pytest.mark.parametrize("with_variant", [False, True])
def test_args_match_the_kernel_signature(with_variant):
    tensors = inputs()
    q, k, v, out, lse = tensors
    shape = check_attention_args(q, k, v, out, lse, require_cuda=False)
    variant = lowered_variant(tensors) if with_variant else None
    args = launch_args(q, k, v, out, lse, shape, 0.125, variant)
    source = KERNEL_PATH.read_text() if variant is None else variant.source
    assert variant is not None or "struct VariantArgs { int unused; };" in source
    params = kernel_params(source, "fa2_sm80_fwd")
    assert len(args) == len(params) == 12
    for value, kind in zip(args, params):
        want = ctypes.sizeof(variant.args) if kind == "VariantArgs" and variant else C_SIZES.get(kind, 8)
        assert ctypes.sizeof(value) == want, (kind, value)
    packed = pack_params(args)
    raw = [ctypes.string_at(packed[i], ctypes.sizeof(a)) for i, a in enumerate(args)]
    assert [int.from_bytes(r, "little") for r in raw[:5]] == [t.data_ptr() for t in tensors]
    ints = [int.from_bytes(r, "little", signed=True) for r in raw[5:10]]
    assert ints == [2, 4, 2, 70, 90]
    assert math.isclose(ctypes.c_float.from_buffer_copy(raw[10]).value, 0.125)
    assert raw[11] == (bytes(variant.args) if variant else bytes(4))


def test_variant_args_point_at_the_kept_tensors():
    variant = lowered_variant(inputs())
    fields = dict(variant.args._fields_)
    assert fields == {"SLOPES": ctypes.c_void_p, "SLOPES_n0": ctypes.c_int32}
    (slopes,) = variant.keep_alive
    assert variant.args.SLOPES == slopes.data_ptr() and variant.args.SLOPES_n0 == slopes.shape[0] == 4


def test_scalar_helpers():
    assert arg_ptr(None).value == 0
    with pytest.raises(LaunchError, match="int32"):
        arg_i32(2**31)


# ------------------------------------------------------------------ LoadedKernel, driver stubbed
class FakeLib:
    """libcuda's calls LoadedKernel makes, recorded in order; every call succeeds."""

    def __init__(self):
        self.calls, self.params = [], None

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args: self.calls.append(name) or 0

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append("cuLaunchKernel")
        self.launch = ((gx, gy, gz), (bx, by, bz), smem, stream.value)
        self.params = [params[i] for i in range(12)]
        return 0


def test_loaded_kernel_loads_and_launches_in_the_primary_context(monkeypatch):
    from cubridge.runtime import driver as drv
    from cubridge.runtime import launch as launch_mod
    lib = FakeLib()
    fake = drv.Driver.__new__(drv.Driver)          # the real methods on the recording lib
    fake.lib, fake.contexts = lib, {}
    monkeypatch.setattr(launch_mod, "driver", lambda: fake)
    kern = launch_mod.LoadedKernel(b"\x7fELF", "fa2_sm80_fwd", 0)
    assert lib.calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2",
                         "cuModuleLoadData", "cuModuleGetFunction", "cuCtxPopCurrent_v2"]
    q, k, v, out, lse = tensors = inputs()
    args = launch_args(q, k, v, out, lse, check_attention_args(q, k, v, out, lse, require_cuda=False), 0.125)
    lib.calls.clear()
    for _ in range(2):
        kern.launch((1, 4, 2), (128, 1, 1), 70000, args, stream_ptr=5)
    assert lib.calls == ["cuCtxPushCurrent_v2", "cuFuncSetAttribute", "cuLaunchKernel", "cuCtxPopCurrent_v2",
                         "cuCtxPushCurrent_v2", "cuLaunchKernel", "cuCtxPopCurrent_v2"]   # opt-in set once
    assert lib.launch == ((1, 4, 2), (128, 1, 1), 70000, 5)
    assert [ctypes.c_uint64.from_address(p).value for p in lib.params[:5]] == [t.data_ptr() for t in tensors]
    with pytest.raises(LaunchError, match="empty grid"):
        kern.launch((0, 4, 2), (128, 1, 1), 0, args)
