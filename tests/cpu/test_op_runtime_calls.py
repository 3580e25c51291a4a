"""What a repeated op call with a runtime input (the document spec's ids) does on the host, with
the GPU side stubbed (no driver, no kernel runs): the torch calls it makes and the launches it
issues, counted (issue 15: a repeated call does no tracing, no host sync, no allocation beyond the
output, the argsort's two and an int64 input's conversion, none but the output with the in-kernel
sort; data-dependent tables are built on the GPU in the same stream, into per-stream buffers).
Session 9 measured 0.7-1.2 ms of host time per such call on the H100 host, mostly lpt_order's ~30
torch calls and a new launch (cubin re-read) per call. Counts, not times: no wall clock here.
GPU behaviour: tests/gpu/test_runtime_inputs.py (tables, tile order, the op under the rule)."""
from __future__ import annotations

import ctypes
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cubridge

op_build = importlib.import_module("cubridge.op.build")    # the module (cubridge.op.build is also the function)

HQ, HKV, D, N, B = 4, 2, 128, 1000, 2


class _Ops(TorchDispatchMode):
    """The aten calls made inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


class _Lib:
    """The driver library the launches reach: records cuLaunchKernel, encodes nothing."""

    def __init__(self):
        self.launches = []

    def cuTensorMapEncodeTiled(self, *a):
        return 0

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        self.launches.append(("attention", [argv[i] for i in range(14)]))
        return 0


class _Kernel:
    """A LoadedKernel stand-in (the block-table and tile-key kernels): records its launches."""

    def __init__(self, name, lib):
        self.name, self.lib = name, lib

    def launch(self, grid, block, smem, args, stream=None):
        self.lib.launches.append((self.name, [a.value if hasattr(a, "value") else a for a in args]))


@pytest.fixture()
def document_op(tmp_path, monkeypatch):
    """The document spec's op on CPU tensors, every GPU touch point stubbed."""
    from cubridge.op import kernels as op_kernels
    from cubridge.op import tuned
    from cubridge.runtime import block_table, driver, fa3_fast, lpt
    from cubridge.runtime.kernels import fa3_sm90 as kfa3
    from cubridge.transfer import call_binding
    monkeypatch.setattr(op_build, "_compile", lambda *a: b"not a cubin")
    run = op_build.build_run("document", tmp_path / "run", heads_q=HQ, heads_kv=HKV, head_dim=D, lengths=(1024,))
    lib = _Lib()
    real = driver.Driver.__new__(driver.Driver)
    real.lib = lib
    real.launch = lambda func, grid, block, smem, stream, params: lib.launches.append(("tile_counts", None))
    for mod in (fa3_fast, fa3_fast.fa3):
        monkeypatch.setattr(mod, "driver", lambda: real)
    monkeypatch.setattr(fa3_fast.fa3, "_TENSOR_MAPS", type(fa3_fast.fa3._TENSOR_MAPS)())
    monkeypatch.setattr(fa3_fast.fa3, "_COUNTERS", {})
    monkeypatch.setattr(fa3_fast, "sm_count", lambda index: 132)
    monkeypatch.setattr(fa3_fast, "current_stream", lambda index: 7)
    monkeypatch.setattr(fa3_fast.fa3, "current_stream", lambda index: 7)
    monkeypatch.setattr(op_kernels, "current_stream", lambda index: 7)
    monkeypatch.setattr(kfa3, "load_cubin", lambda cubin, config, device: (ctypes.c_void_p(1), ctypes.c_void_p(2)))
    monkeypatch.setattr(block_table, "_kernel", lambda source, device: _Kernel("block_table", lib))
    monkeypatch.setattr(lpt, "_kernel", lambda device, entry=lpt.ENTRY: _Kernel(entry.removeprefix("cubridge_"), lib))
    monkeypatch.setattr(call_binding, "builds_on_device", lambda device: True)
    monkeypatch.setattr(call_binding, "_CACHE", type(call_binding._CACHE)())   # its binders hold the stubs
    monkeypatch.setattr(tuned, "device_checked", lambda arch, index: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # (both raise in a CPU build)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    attn = cubridge.load(run)
    attn.device_type = "cpu"
    return attn, lib


def _ids(seed):
    """Sorted document ids [B, N] (int32, as the kernels read them), a new layout per seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 400, (B, N // 50), generator=g).cumsum(1)
    return torch.stack([torch.bucketize(torch.arange(N), row, right=True) for row in lengths]).to(torch.int32)


def test_a_repeated_runtime_call_makes_three_torch_calls_and_four_launches(document_op, monkeypatch):
    """The key kernel + argsort path (runtime.lpt.SORT_IN_KERNEL off; past SORT_MAX tiles it is taken anyway)."""
    from cubridge.runtime import lpt
    monkeypatch.setattr(lpt, "SORT_IN_KERNEL", False)
    attn, lib = document_op
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, N, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, HKV, N, D, generator=g).to(torch.bfloat16) for _ in range(2))
    attn(q, k, v, doc_ids=_ids(1))                   # the shape's first call builds the launch
    attn(q, k, v, doc_ids=_ids(2))
    ids = _ids(3)
    lib.launches.clear()
    with _Ops() as seen:
        attn(q, k, v, doc_ids=ids)
    # out, the tile keys' argsort and its int32 copy: the table, counts and keys are the shape's
    # buffers for this stream (driver.scratch_tensor), allocated on the first call
    assert sorted(seen.ops) == sorted(["new_empty", "sort", "_to_copy"]), seen.ops
    assert [name for name, _ in lib.launches] == ["block_table", "tile_counts", "lpt_keys", "attention"]
    # the launch reads this call's ids and the table built for it (VariantArgs, argument 13)
    table_args, (_, argv) = lib.launches[0][1], lib.launches[-1]
    prep = next(iter(attn._prepared.values()))
    struct = type(prep._launch.variant.args)
    fields = struct.from_buffer_copy(struct.from_address(argv[13]))
    assert fields.DOC_IDS == ids.data_ptr() and fields.BLOCK_CLASS == table_args[1]
    assert ctypes.c_uint64.from_address(argv[6]).value == prep._launch.order.data_ptr()
    assert len(attn._prepared) == 1 and not attn._captured
    other = _ids(4)
    attn(q, k, v, doc_ids=other)                     # the next call: same table buffer, its own ids
    again = struct.from_address(lib.launches[-1][1][13])
    assert again.BLOCK_CLASS == fields.BLOCK_CLASS and again.DOC_IDS == other.data_ptr() != ids.data_ptr()


def test_int64_ids_cost_one_conversion(document_op):
    """The default path (the in-kernel tile sort): the output and the ids' int32 copy."""
    attn, lib = document_op
    q = torch.randn(B, HQ, N, D).to(torch.bfloat16)
    k = v = torch.randn(B, HKV, N, D).to(torch.bfloat16)
    attn(q, k, v, doc_ids=_ids(1).long())            # builds the launch
    attn(q, k, v, doc_ids=_ids(2).long())            # the first rebind: this stream's buffers
    ids = _ids(3).long()
    with _Ops() as seen:
        attn(q, k, v, doc_ids=ids)
    assert sorted(seen.ops) == sorted(["new_empty", "_to_copy"]), seen.ops


def test_the_in_kernel_tile_sort_drops_the_argsort(document_op, monkeypatch):
    """runtime.lpt.SORT_IN_KERNEL (the default since session 9's H100 run): the order comes from one
    kernel, so a call allocates only the output (the order is a scratch buffer too); past SORT_MAX
    tiles it falls back to argsort."""
    from cubridge.runtime import lpt
    assert lpt.SORT_IN_KERNEL
    attn, lib = document_op
    q = torch.randn(B, HQ, N, D).to(torch.bfloat16)
    k = v = torch.randn(B, HKV, N, D).to(torch.bfloat16)
    attn(q, k, v, doc_ids=_ids(1))
    attn(q, k, v, doc_ids=_ids(2))
    ids = _ids(3)
    lib.launches.clear()
    with _Ops() as seen:
        attn(q, k, v, doc_ids=ids)
    assert seen.ops == ["new_empty"], seen.ops
    assert [name for name, _ in lib.launches] == ["block_table", "tile_counts", "lpt_order", "attention"]
    monkeypatch.setattr(lpt, "SORT_MAX", 4)            # 2 x 4 x 8 tiles here: more than the kernel holds
    with _Ops() as seen:
        attn(q, k, v, doc_ids=ids)
    assert "sort" in seen.ops and lib.launches[-2][0] == "lpt_keys"


def test_two_threads_at_one_shape_each_launch_on_their_own_ids(document_op, monkeypatch):
    """Two threads call the document op at one shape. Thread A is held inside its call after its
    table build and rebind, just before its attention launch (in the stubbed current_stream of
    Fa3Launch.__call__), until thread B's whole call has finished or 0.5 s have passed: without the
    shape's lock B rebinds and launches in that window and A then launches on B's ids and tables;
    with it B waits for A. Every attention launch must read the ids of the thread that made it."""
    import threading
    from cubridge.runtime import fa3_fast
    attn, lib = document_op
    q = torch.randn(B, HQ, N, D).to(torch.bfloat16)
    k = v = torch.randn(B, HKV, N, D).to(torch.bfloat16)
    attn(q, k, v, doc_ids=_ids(1))                   # the shape's launch exists before the threads start
    attn(q, k, v, doc_ids=_ids(2))
    prep = next(iter(attn._prepared.values()))
    struct = type(prep._launch.variant.args)
    a_inside, b_done, seen = threading.Event(), threading.Event(), []
    record = lib.cuLaunchKernel

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        seen.append((threading.current_thread().name, struct.from_address(argv[13]).DOC_IDS))
        return record(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra)

    def held_stream(index):
        if threading.current_thread().name == "A":
            a_inside.set()
            b_done.wait(0.5)
        return 7
    monkeypatch.setattr(lib, "cuLaunchKernel", launch)
    monkeypatch.setattr(fa3_fast, "current_stream", held_stream)
    ids = {"A": _ids(3), "B": _ids(4)}

    def b():
        a_inside.wait(5)
        attn(q, k, v, doc_ids=ids["B"])
        b_done.set()
    threads = [threading.Thread(target=lambda: attn(q, k, v, doc_ids=ids["A"]), name="A"),
               threading.Thread(target=b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(name for name, _ in seen) == ["A", "B"]
    assert all(ptr == ids[name].data_ptr() for name, ptr in seen), seen
