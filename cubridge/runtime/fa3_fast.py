"""The cached launch of a (lowered) fa3_sm90 kernel: the tuned op's fast path.

fa3_forward re-derives everything on every call (config checks, the capability query, the grid,
the tile order, the packed argument list). An op called thousands of times at one shape needs none
of that again: `Fa3Launch` is built once per (kernel, shape) and keeps the loaded function, the
grid, the tile order (computed on the GPU once, at build time, never inside a CUDA-graph capture)
and the packed scalar tail of the argument list. A call then only encodes (or finds in the cache
fa3_sm90.tensor_map keeps for both paths) the four TMA descriptors, fetches the stream's tile counter and calls cuLaunchKernel: no host sync, no
allocation, no host-to-device copy, so it can be captured in a CUDA graph. A caller that fixes the
shapes and strides (the op's checked call signature) takes `fixed_layout`'s call, keyed by the
addresses alone.

Strided inputs: the kernel's TMA maps are 4-D, (D, N, H, B) with a box of one head, so a
[B, H, N, D] view is read (and O written) in place when its last dim is contiguous and its other
strides are 16-byte multiples: contiguous [B, H, N, D], and [B, N, H, D] memory seen as
[B, H, N, D] (transformers' transposed projections) at any B. `fa3_sm90.map_refusal` says why a
view does not qualify.

Example (on an sm_90 GPU):
    >>> fn, counts = load_cubin(cubin, config, q.device)                     # doctest: +SKIP
    >>> launch = Fa3Launch(fn, counts, config, q.device, B, Hq, Hkv, N, N, 0.088, variant)   # doctest: +SKIP
    >>> launch(q, k, v, out, lse)                                            # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import math

import torch

from cubridge.errors import LaunchError
from cubridge.runtime import fa3_sm90 as fa3
from cubridge.runtime.driver import current_stream, driver, sm_count

_LOADED: dict = {}
ARGV_CACHE = 64          # packed argument arrays per launch, by (addresses, strides, stream)


def load_cubin(cubin: bytes, config: fa3.Fa3Config, device: torch.device):
    """(attention function, tile-count function) of a cubin on `device`, loaded once."""
    key = (hash(cubin), len(cubin), config.smem_bytes, device.index)
    if key not in _LOADED:
        fa3.check_cubin(cubin)
        with driver().primary_context(device.index):   # torch's context; no stream touched (graph capture)
            _LOADED[key] = driver().load_function(cubin, config.smem_bytes, fa3.ENTRY, fa3.COUNTS_ENTRY)
    return _LOADED[key]


class Fa3Launch:
    """One kernel at one shape, ready to launch on the current stream: call(q, k, v, out, lse)."""

    def __init__(self, func, counts_func, config: fa3.Fa3Config, device: torch.device, b: int, hq: int, hkv: int,
                 nq: int, nk: int, scale: float, variant=None):
        if not (scale > 0 and math.isfinite(scale)):
            raise LaunchError(f"scale={scale!r} is not a positive finite number", where="scale",
                              hint="the kernel takes row maxima of unscaled scores; the default is 1/sqrt(D)")
        self.func, self.config, self.device, self.variant = func, config, device, variant
        sms = sm_count(device.index)
        tiles = math.ceil(nq / config.block_m) * hq * b
        self.grid = min(tiles, sms) if config.persistent else tiles
        self._counts, self._shape = counts_func, (b, hq, hkv, nq, nk, min(self.grid, sms))
        self.order = (fa3.tile_order(counts_func, config, variant, device, *self._shape)
                      if variant is not None else None)
        # the launch's own copy of VariantArgs: rebind() rewrites it in place, where argv points
        args = type(variant.args).from_buffer_copy(variant.args) if variant is not None else ctypes.c_int32(0)
        self._tail = [ctypes.c_uint64(self.order.data_ptr() if self.order is not None else 0),
                      ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(hq), ctypes.c_int32(hkv),
                      ctypes.c_int32(b), ctypes.c_float(scale), args]
        self._tail_ptrs = [ctypes.addressof(x) for x in self._tail]
        self._argv = ctypes.c_void_p * (6 + len(self._tail))
        self._lib = driver().lib
        self._argvs: dict = {}
        self._threads, self._smem = config.threads, config.smem_bytes    # properties: computed once here

    def __call__(self, q, k, v, out, lse) -> None:
        stream = current_stream(self.device.index)
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), stream,
               q.stride(), k.stride(), v.stride(), out.stride())
        argv = self._argvs.get(key)
        if argv is None:
            argv = self._pack(key, q, k, v, out, lse, stream)
        # the stream as a plain int (argtypes make it a void *): a c_void_p object per call is host time
        result = self._lib.cuLaunchKernel(self.func, self.grid, 1, 1, self._threads, 1, 1, self._smem, stream,
                                          argv[0], None)
        if result:
            driver().check(result, "cuLaunchKernel")

    def fixed_layout(self, views):
        """call(q, k, v, out, lse) for a caller whose tensors always have one shape and one set of
        strides (the tuned op's checked call signature): the argument array is found by the five
        addresses and the stream alone, and `views(q, k, v, out)` (the [B, H, N, D] views the
        kernel reads) runs only to pack a new one. Four stride() calls, a 10-tuple and the views'
        transposes per call were ~1-3 us of the op's host path on the CPU host (cubridge/op/NOTES.md 10).
        The caller guarantees the fixed shapes and strides; anything else must use __call__."""
        tag = object()      # this caller's keys never meet __call__'s or another caller's
        argvs, lib, func, grid, threads, smem, index = (self._argvs, self._lib, self.func, self.grid,
                                                        self._threads, self._smem, self.device.index)

        def call(q, k, v, out, lse) -> None:
            stream = current_stream(index)
            key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), stream, tag)
            argv = argvs.get(key)
            if argv is None:
                argv = self._pack(key, *views(q, k, v, out), lse, stream)
            result = lib.cuLaunchKernel(func, grid, 1, 1, threads, 1, 1, smem, stream, argv[0], None)
            if result:
                driver().check(result, "cuLaunchKernel")
        return call

    def rebind(self, variant, scratch: dict | None = None) -> None:
        """Point the next launches at `variant` (a call's runtime inputs: new tables, same layout)
        and at its tile order, counted and ordered on the GPU (tile_order): the argument arrays
        keep their addresses, only the values they point to change (cuLaunchKernel copies them at
        the launch, so an earlier launch, or one a CUDA graph captured, is not affected)."""
        if type(variant.args) is not type(self._tail[-1]):
            raise LaunchError("rebind: the variant's VariantArgs layout differs from the one this launch was built "
                              "with", hint="build a new Fa3Launch for another lowered kernel")
        self.variant = variant
        self.order = fa3.tile_order(self._counts, self.config, variant, self.device, *self._shape, scratch=scratch)
        self._tail[0].value = self.order.data_ptr()
        ctypes.memmove(ctypes.addressof(self._tail[-1]), ctypes.addressof(variant.args), ctypes.sizeof(variant.args))

    def _pack(self, key, q, k, v, out, lse, stream):
        """The argument array for these addresses (kept with the objects it points to). A model
        calls with the same few buffers over and over (the caching allocator reuses blocks), so
        a repeated call finds its array here and packs nothing."""
        c = self.config
        counter = fa3.launch_counter(self.device, stream, c)
        head = [fa3.tensor_map(q, c.block_m), fa3.tensor_map(k, c.block_n), fa3.tensor_map(v, c.block_n),
                fa3.tensor_map(out, fa3.WG_ROWS), ctypes.c_uint64(lse.data_ptr()), ctypes.c_uint64(counter.data_ptr())]
        argv = (self._argv(*[ctypes.addressof(x) for x in head], *self._tail_ptrs), head)
        if len(self._argvs) >= ARGV_CACHE:
            self._argvs.pop(next(iter(self._argvs)))
        self._argvs[key] = argv
        return argv
