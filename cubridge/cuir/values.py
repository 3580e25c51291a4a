"""Run-time values of the CuIR interpreter, and the lane convention that vectorises it.

Blocks of the grid whose axes never steer control flow (batch and head, in attention) are run
together: every tensor value carries `nl` leading *lane* dims, one per vectorised grid axis
(size 1 where the value is the same for all blocks on that axis). Everything after the lane dims
is the tile. Uniform scalars (loop counters, tile offsets) stay Python numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int64}
BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
UNWRITTEN = ("unwritten",)        # token of shared memory nothing has written yet


def round_to(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Round a float32 tensor to `dtype` and back: storage in fp32, values exactly representable."""
    if dtype in ("f16", "bf16"):
        return x.to(TORCH_DTYPES[dtype]).to(torch.float32)
    if dtype == "i32":
        return x.to(torch.int64)
    return x.to(torch.float32) if x.dtype != torch.float32 else x


@dataclass
class GTensor:
    """A tensor in global memory. `data` is fp32 (or int64) with the kernel's values."""
    name: str
    dtype: str
    data: torch.Tensor
    is_output: bool
    decl_line: int
    written: torch.Tensor | None = None       # outputs: which elements some store wrote
    store_lines: set = field(default_factory=set)


@dataclass
class SmemBuffer:
    """A shared-memory buffer of one block (per lane). `tokens[i]` says how leading row i was last
    written and what a reader must have waited on before reading it."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: torch.Tensor                          # [*lanes, *shape], fp32, NaN until written
    tokens: list
    decl_line: int


@dataclass
class SmemView:
    buf: SmemBuffer
    index: tuple                                # ints and (lo, hi) pairs on the leading dims
    transposed: bool = False

    def rows(self) -> range:
        """Leading-dim rows the view covers."""
        if not self.index:
            return range(self.buf.shape[0])
        first = self.index[0]
        return range(first[0], first[1]) if isinstance(first, tuple) else range(first, first + 1)

    @property
    def shape(self) -> tuple[int, ...]:
        dims = []
        for i, n in enumerate(self.buf.shape):
            if i < len(self.index):
                ix = self.index[i]
                if isinstance(ix, tuple):
                    dims.append(ix[1] - ix[0])
            else:
                dims.append(n)
        if self.transposed:
            dims[-2], dims[-1] = dims[-1], dims[-2]
        return tuple(dims)


@dataclass
class GView:
    """A subscripted global tensor: per dim an int, a lane tensor, or a (lo, hi) slice."""
    g: GTensor
    index: tuple


@dataclass
class Barrier:
    """An mbarrier: `count` arrivals complete a phase; `completed` counts completed phases."""
    name: str
    count: int
    completed: int = 0
    arrivals: int = 0
    last_line: int = 0        # the line of the latest arrival (named when a wait on it hangs)

    def arrive(self) -> int:
        """One arrival; returns the index of the phase it contributed to."""
        phase = self.completed
        self.arrivals += 1
        if self.arrivals >= self.count:
            self.completed += 1
            self.arrivals = 0
        return phase

    def ready(self, parity: int) -> bool:
        # mbarrier.try_wait.parity semantics: the phase in progress has parity completed % 2;
        # waiting on the other parity returns at once.
        return self.completed % 2 != parity

    def observed_phase(self, parity: int) -> int:
        """Index of the latest completed phase with this parity (-1 if none)."""
        last = self.completed - 1
        return last if last % 2 == parity else last - 1


@dataclass
class BarrierArray:
    name: str
    bars: list

    def __len__(self):
        return len(self.bars)


@dataclass
class Pending:
    """Result of mma_async: usable only once an mma_wait has retired it."""
    value: torch.Tensor
    line: int
    done: bool = False


@dataclass
class DType:
    name: str      # "f32", "f16", "bf16", "i32"
