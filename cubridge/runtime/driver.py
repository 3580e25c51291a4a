"""The CUDA driver API through ctypes: the few calls cubridge's launchers need (module load,
function lookup, dynamic shared memory, TMA tensor maps, kernel launch), errors turned into
cubridge.errors.LaunchError. No CUDA Python package is needed; libcuda.so.1 is opened on first use.

Public names (other modules build on them; keep them stable): Driver, driver(), sm_count(),
capability(), pack_params() and the CU_* / TENSOR_MAP_* constants.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

from cubridge.errors import LaunchError

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0   # out-of-bounds elements read as zero
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
PANEL_COLS = 64          # default TMA box width for 2-byte data: 128 bytes, the swizzle span


class Driver:
    """The handful of CUDA driver calls cubridge needs, with errors turned into exceptions."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        self.lib.cuTensorMapEncodeTiled.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p,
            u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                 ctypes.c_char_p]
        self.lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        # cuda.h maps cuCtxPushCurrent / cuCtxPopCurrent to these _v2 symbols (the plain names are
        # the pre-4.0 ABI, kept in libcuda for old binaries).
        self.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.contexts: dict[int, ctypes.c_void_p] = {}

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise LaunchError(f"{what} failed: CUDA driver error {result} ({text})")

    @contextlib.contextmanager
    def primary_context(self, device_index: int):
        """Runs the block in the primary context of device `device_index` (the one the CUDA
        runtime and torch use), the thread's own current context restored after. It touches no
        stream, so it is safe inside a CUDA graph capture, unlike a stream synchronisation."""
        ctx = self.contexts.get(device_index)
        if ctx is None:
            self.check(self.lib.cuInit(0), "cuInit")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.contexts[device_index] = ctx
        self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent_v2")
        try:
            yield
        finally:
            self.check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent_v2")

    def load_module(self, cubin: bytes) -> ctypes.c_void_p:
        """Loads a cubin into the current context (the caller makes the right one current)."""
        module = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        return module

    def get_function(self, module: ctypes.c_void_p, entry: bytes, smem_bytes: int | None = None
                     ) -> ctypes.c_void_p:
        """The entry `entry` of `module`; with smem_bytes, its dynamic shared memory limit set."""
        func = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(func), module, entry),
                   "cuModuleGetFunction")
        if smem_bytes is not None:
            self.set_dynamic_smem(func, smem_bytes)
        return func

    def set_dynamic_smem(self, func: ctypes.c_void_p, smem_bytes: int) -> None:
        """Lets `func` launch with up to `smem_bytes` of dynamic shared memory (above 48 KB it
        must opt in)."""
        self.check(self.lib.cuFuncSetAttribute(func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               smem_bytes), "cuFuncSetAttribute")

    def load_function(self, cubin: bytes, smem_bytes: int, entry: bytes,
                      *others: bytes) -> tuple[ctypes.c_void_p, ...]:
        """Loads `cubin`; returns `entry` (its dynamic shared memory set) and then each of `others`."""
        module = self.load_module(cubin)
        return (self.get_function(module, entry, smem_bytes),
                *(self.get_function(module, name) for name in others))

    def tensor_map(self, t: torch.Tensor, rows_per_box: int, panel_cols: int = PANEL_COLS,
                   strides: tuple[int, int] | None = None) -> ctypes.Array:
        """3-D map over a [B, H, N, D] tensor seen as (D, N, B*H): zero fill stops at each head's N.
        The box is panel_cols x rows_per_box x 1, swizzled 128B. `strides`: (row, head) strides in
        elements of a view whose B and H collapse into one stride; default: contiguous."""
        b, h, n, d = t.shape
        row, head = strides if strides is not None else (d, n * d)
        return self.encode_tiled(t, (d, n, b * h), (row, head), (panel_cols, rows_per_box, 1))

    def tensor_map_4d(self, t: torch.Tensor, rows_per_box: int, strides: tuple[int, int, int],
                      panel_cols: int = PANEL_COLS) -> ctypes.Array:
        """4-D map over a [B, H, N, D] view seen as (D, N, H, B), `strides` its (row, head, batch)
        strides in elements (any order: [B, N, H, D] memory has head < row). The box is one head
        of one batch, panel_cols x rows_per_box, swizzled 128B; zero fill stops at each head's N."""
        b, h, n, d = t.shape
        return self.encode_tiled(t, (d, n, h, b), strides, (panel_cols, rows_per_box, 1, 1))

    def encode_tiled(self, t: torch.Tensor, dims: tuple, strides: tuple, box: tuple) -> ctypes.Array:
        """cuTensorMapEncodeTiled over t's memory: dims innermost first, the strides (elements) of
        every dim but the first, a box per dim, 128B swizzle; 64-byte-aligned 128-byte result."""
        elem = t.element_size()
        rank = len(dims)
        dtype = (CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if t.dtype == torch.bfloat16
                 else CU_TENSOR_MAP_DATA_TYPE_FLOAT16)
        gdims = (ctypes.c_uint64 * rank)(*dims)
        gstrides = (ctypes.c_uint64 * (rank - 1))(*(s * elem for s in strides))
        gbox = (ctypes.c_uint32 * rank)(*box)
        elem_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
        raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
        offset = (-ctypes.addressof(raw)) % TENSOR_MAP_ALIGN
        view = (ctypes.c_uint8 * TENSOR_MAP_BYTES).from_buffer(raw, offset)
        self.check(self.lib.cuTensorMapEncodeTiled(
            ctypes.addressof(view), dtype, rank, ctypes.c_void_p(t.data_ptr()), gdims, gstrides, gbox,
            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
            "cuTensorMapEncodeTiled")
        return view

    def launch(self, func: ctypes.c_void_p, grid: tuple[int, int, int], block: tuple[int, int, int],
               smem_bytes: int, stream: int, params: ctypes.Array) -> None:
        """cuLaunchKernel on `stream` (a raw CUstream handle) with params from pack_params()."""
        self.check(self.lib.cuLaunchKernel(func, *grid, *block, smem_bytes, ctypes.c_void_p(stream),
                                           params, None), "cuLaunchKernel")


def current_stream(index: int) -> int:
    """The raw handle of the current CUDA stream of device `index` (torch's own accessor: a
    torch.cuda.Stream object per call costs ~1-2 us of the op's host budget)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def scratch_tensor(scratch: dict | None, name: str, shape: tuple, dtype, device) -> torch.Tensor:
    """torch.empty(shape), or the buffer `scratch` keeps under `name` (made on first use). The op
    with runtime inputs keeps one scratch per (shape, stream) for its per-call tables: one stream
    runs each call's kernels before the next call's, so reusing them is safe there and saves an
    allocation per table per call (never inside a CUDA graph capture: the graph keeps its own)."""
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    t = scratch.get(name)
    if t is None or t.shape != shape:
        t = scratch[name] = torch.empty(shape, dtype=dtype, device=device)
    return t


def pack_params(args) -> ctypes.Array:
    """The kernelParams array for cuLaunchKernel: the address of each ctypes object in `args`
    (which must stay alive until the launch call returns)."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])


_DRIVER: Driver | None = None


def driver() -> Driver:
    """The process-wide Driver (libcuda opened on first call)."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = Driver()
    return _DRIVER


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
