"""A stand-in for libcuda's launch calls in CPU tests: records cuTensorMapEncodeTiled (the map's
rank, address, dims, byte strides, box) and cuLaunchKernel (grid, threads, shared memory and the
first 14 argument pointers) and succeeds. Install it with `recording_launches(monkeypatch)`
(runtime.fa3_fast and fa3_sm90 then encode and launch through it, stream 7, 132 SMs, an empty
descriptor cache), or assign it to a Driver's `lib` yourself.

Imported as `support.fake_driver` (tests/ is on sys.path through tests/conftest.py's folder).
"""
from __future__ import annotations


class FakeLib:
    """Records cuTensorMapEncodeTiled / cuLaunchKernel calls; every call succeeds."""

    def __init__(self):
        self.encoded, self.launches, self.maps = 0, [], []

    def cuTensorMapEncodeTiled(self, out, dtype, rank, ptr, dims, strides, box, elem_strides, *modes):
        self.encoded += 1
        self.maps.append(dict(rank=rank, ptr=ptr.value, dims=list(dims[:rank]), strides=list(strides[:rank - 1]),
                              box=list(box[:rank]), elem_strides=list(elem_strides[:rank])))
        return 0

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        self.launches.append(((gx, bx, smem), [argv[i] for i in range(14)]))
        return 0


def recording_launches(monkeypatch):
    """(FakeLib, runtime.fa3_fast) with Fa3Launch and the descriptor cache on the recording driver."""
    from cubridge.runtime import driver as drv
    from cubridge.runtime import fa3_fast
    lib = FakeLib()
    real = drv.Driver.__new__(drv.Driver)
    real.lib = lib
    monkeypatch.setattr(fa3_fast, "driver", lambda: real)
    monkeypatch.setattr(fa3_fast.fa3, "driver", lambda: real)
    monkeypatch.setattr(fa3_fast.fa3, "_TENSOR_MAPS", type(fa3_fast.fa3._TENSOR_MAPS)())
    monkeypatch.setattr(fa3_fast, "sm_count", lambda index: 132)
    monkeypatch.setattr(fa3_fast, "current_stream", lambda index: 7)
    return lib, fa3_fast
