"""Load cubins and launch them on torch tensors, on the current torch stream.

Everything a kernel would silently get wrong is rejected here first: `check_attention_args`
validates shapes, dtypes, devices, contiguity and aliasing and raises LaunchError saying what was
expected. Loading and launching go through the CUDA driver API (runtime/driver.py, ctypes on
libcuda, opened on first use: the checks need no GPU).

Example (GPU):
    >>> kern = LoadedKernel(cubin_bytes, "fa2_sm80_fwd", device_index=0)     # doctest: +SKIP
    >>> kern.launch((grid_x, heads, batch), (128, 1, 1), smem_bytes, args)  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from cubridge.errors import LaunchError
from cubridge.runtime.driver import current_stream, driver, pack_params

ATTN_DTYPES = (torch.float16, torch.bfloat16)
MAX_GRID_YZ = 65535          # CUDA limit on gridDim.y and gridDim.z
MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class AttnShape:
    """Sizes of one attention call: q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]."""
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return (f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Nq={self.len_q} Nk={self.len_k} "
                f"D={self.head_dim} {str(self.dtype).removeprefix('torch.')}")


def _fail(what: str, expected: str, got: str) -> LaunchError:
    return LaunchError(f"{what}: expected {expected}, got {got}", where="attention inputs")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_attention_args(q, k, v, out=None, lse=None, *, head_dims: Sequence[int] = (64, 128),
                         require_cuda: bool = True, strided: bool = False) -> AttnShape:
    """Validate an attention call before launch; return its sizes. Raises LaunchError. strided: q, k,
    v (and out) may be any [B, H, N, D] view (the caller's kernel checks its strides, e.g. through
    its TMA maps); otherwise they must be contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _fail(name, "a torch.Tensor", type(t).__name__)
        if t.dim() != 4:
            raise _fail(f"{name} shape", "4 dims [B, H, N, D]", _describe(t))
        if t.dtype not in ATTN_DTYPES:
            raise _fail(f"{name} dtype", "float16 or bfloat16", _describe(t))
        if not strided and not t.is_contiguous():
            raise _fail(f"{name} layout", "contiguous [B, H, N, D] (call .contiguous())",
                        f"strides {t.stride()} for {_describe(t)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail("dtypes", f"q, k, v all {q.dtype}", f"k {k.dtype}, v {v.dtype}")
    batch, heads_q, len_q, head_dim = q.shape
    _, heads_kv, len_k, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise _fail("k shape", f"[{batch}, Hkv, Nk, {head_dim}] (same B and D as q {tuple(q.shape)})",
                    _describe(k))
    if v.shape != k.shape:
        raise _fail("v shape", f"the shape of k {tuple(k.shape)}", _describe(v))
    if head_dim not in head_dims:
        raise _fail("head dim D", f"one of {tuple(head_dims)}", f"{head_dim} in q {_describe(q)}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise _fail("heads", "Hq a multiple of Hkv (MHA, GQA or MQA)", f"Hq={heads_q}, Hkv={heads_kv}")
    if batch > MAX_GRID_YZ or heads_q > MAX_GRID_YZ:
        raise _fail("grid", f"B and Hq <= {MAX_GRID_YZ}", f"B={batch}, Hq={heads_q}")
    if max(len_q, len_k) * head_dim > MAX_INT32:
        raise _fail("lengths", f"N * D <= {MAX_INT32} (32-bit row offsets within one head)",
                    f"Nq={len_q}, Nk={len_k}, D={head_dim}")
    shape = AttnShape(batch, heads_q, heads_kv, len_q, len_k, head_dim, q.dtype)
    if out is not None:
        check_output("out", out, tuple(q.shape), q.dtype, q, k, v, strided=strided)
    if lse is not None:
        check_output("lse", lse, (batch, heads_q, len_q), torch.float32, q, k, v)
    if out is not None and lse is not None and overlaps(out, lse):
        raise _fail("lse memory", "separate from out", "overlapping buffers")
    devices = {t.device for t in (q, k, v, out, lse) if t is not None}
    if len(devices) != 1:
        raise _fail("devices", "all tensors on one device", ", ".join(sorted(map(str, devices))))
    if require_cuda and q.device.type != "cuda":
        raise _fail("device", "CUDA tensors", str(q.device))
    return shape


def check_output(name, t, shape, dtype, *inputs, strided: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise _fail(name, f"{shape} {str(dtype).removeprefix('torch.')}", _describe(t))
    if not strided and not t.is_contiguous():
        raise _fail(f"{name} layout", "contiguous", f"strides {t.stride()}")
    for iname, i in zip("qkv", inputs):
        if overlaps(t, i):
            raise _fail(f"{name} memory", "separate from the inputs", f"it overlaps {iname}")


def device_arch(device: torch.device | int | None = None) -> str:
    """'sm_90' for an H100: the cubin target of a torch device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def arg_ptr(t: torch.Tensor | None) -> ctypes.c_uint64:
    """A device pointer argument; None is the null pointer."""
    return ctypes.c_uint64(0 if t is None else t.data_ptr())


def arg_i32(x: int) -> ctypes.c_int32:
    if not -2**31 <= x <= MAX_INT32:
        raise LaunchError(f"kernel argument {x} does not fit in int32")
    return ctypes.c_int32(x)


def arg_i64(x: int) -> ctypes.c_int64:
    return ctypes.c_int64(x)


def arg_f32(x: float) -> ctypes.c_float:
    return ctypes.c_float(x)


class LoadedKernel:
    """One `extern "C"` entry point of a cubin, loaded on one device through the driver API
    (runtime/driver.py, the one launch path: fa3's launchers call it directly)."""

    def __init__(self, cubin: bytes, name: str, device_index: int):
        self.name = name
        self.device_index = device_index
        with driver().primary_context(device_index):    # the module loads into torch's context
            self.func = driver().get_function(driver().load_module(cubin), name.encode())
        self.smem_optin = 0

    def __repr__(self) -> str:
        return f"LoadedKernel({self.name!r}, device={self.device_index})"

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
               args: Sequence, stream_ptr: int | None = None) -> None:
        """Launch on `stream_ptr` (default: torch's current stream of this device). `args`: one
        ctypes value per kernel parameter (arg_ptr, arg_i32, ..., a VariantArgs structure)."""
        if min(grid) <= 0:
            raise LaunchError(f"empty grid {grid}: nothing to launch (caller should skip)")
        if stream_ptr is None:
            stream_ptr = current_stream(self.device_index)
        with driver().primary_context(self.device_index):   # the module's context, whatever is current
            if smem_bytes > self.smem_optin:
                driver().set_dynamic_smem(self.func, smem_bytes)
                self.smem_optin = smem_bytes
            driver().launch(self.func, tuple(grid), tuple(block), smem_bytes, stream_ptr, pack_params(args))
