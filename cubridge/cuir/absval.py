"""Abstract values of the static checker (tile shapes concrete, run-time sizes unknown)."""
from __future__ import annotations

from dataclasses import dataclass, field

SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
              "sm_90a": 227 * 1024}
SIXTEEN_BIT = ("f16", "bf16")
ELT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "bool": 1}


# ------------------------------------------------------------------ abstract values
@dataclass(frozen=True)
class Scalar:
    kind: str                  # int, float, bool
    value: object = None       # known value, or None when it depends on run-time sizes


@dataclass(frozen=True)
class Tile:
    dtype: str                 # f32, f16, bf16, i32, bool
    shape: tuple


@dataclass(frozen=True)
class Buf:
    name: str
    dtype: str
    shape: tuple


@dataclass(frozen=True)
class View:                    # a shared-memory view
    buf: Buf
    shape: tuple


@dataclass(frozen=True)
class Glob:
    name: str
    dtype: str
    rank: int
    is_output: bool
    dims: tuple                # known sizes or None


@dataclass(frozen=True)
class GView:
    g: Glob
    shape: tuple


@dataclass(frozen=True)
class Bar:
    name: str
    n: int | None              # None: a single barrier
    count: int


@dataclass(frozen=True)
class DT:
    name: str


@dataclass
class CheckReport:
    smem_bytes: int
    buffers: dict = field(default_factory=dict)   # name -> bytes
    roles: list = field(default_factory=list)      # (name, warps, count)
    params: dict = field(default_factory=dict)
