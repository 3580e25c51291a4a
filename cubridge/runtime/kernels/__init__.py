"""One interface per reference kernel: what the rest of cubridge may know about a kernel.

A reference kernel is a folder (`ref_kernels/<name>/`: kernel.cu, kernel.cuir, README) and one
`ReferenceKernel` subclass, registered by name with `@register`. Everything kernel-specific that
the transfer, lowering, compile, search and load paths need goes through it: the tile search
space, the -D flags of a point, the compile options, the region generator the lowering patches
kernel.cu with, the input checks, the search's launcher and the tuned op's per-shape launch (with
its untuned default tile and the strided views it reads in place). No code outside a kernel's own
modules tests a kernel's name (tests/cpu/test_kernel_names.py).

The launcher contract (search/measure.py, cubridge.load, tests):

    kernel = reference_kernel("fa3_sm90")
    prepare = kernel.launcher(lowered, cubin, point)     # lowered: cubridge.lower.LoweredKernel
    call = prepare(extra_inputs, device)                 # the variant's bound inputs, packed once
    call(q, k, v, out)                                   # out preallocated, written in place
    out, lse = call(q, k, v, out, lse)                   # lse too (float32 [B, Hq, Nq]); both returned

Example:
    >>> k = reference_kernel("fa2_sm80")
    >>> k.arch, k.space.kernel
    ('sm_80', 'fa2_sm80')
    >>> k.defines({"block_m": 128, "block_n": 64, "stages": 2, "warps": 4}, 128, "bf16")[:2]
    ['-DBLOCK_M=128', '-DBLOCK_N=64']
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, ClassVar

from cubridge.errors import CubridgeError
from cubridge.paths import REF_KERNELS_DIR
from cubridge.runtime.space import Space
from cubridge.vocab import DTYPES


# (extra inputs, device) -> call(q, k, v, out, lse=None) -> (out, lse): the LSE (float32
# [B, Hq, Nq], natural log, -inf for a row with no key) is an output the GPU check compares.
Prepare = Callable[[dict, object], Callable]
ShapeLaunch = Callable[..., None]               # launch(q, k, v, out, lse), written in place


class ReferenceKernel(ABC):
    """An expert kernel that cubridge transfers variants onto. Subclasses set the class attributes
    and implement the abstract methods; `@register` makes the kernel known by `name`."""
    name: ClassVar[str]            # the folder under ref_kernels/ and the name in configs / --ref
    arch: ClassVar[str]            # its lowest target ("sm_80"); a run compiles for its config's arch
    generator: ClassVar[str]       # module with lower_source(kernel_cu, VariantIR) -> str
    space: ClassVar[Space]         # its tile configurations

    @property
    def directory(self) -> Path:
        """kernel.cu, kernel.cuir and the headers kernel.cu includes."""
        return REF_KERNELS_DIR / self.name

    def source(self) -> str:
        return (self.directory / "kernel.cu").read_text()

    def cuir_path(self) -> Path:
        return self.directory / "kernel.cuir"

    @abstractmethod
    def defines(self, point: dict, head_dim: int, dtype: str) -> list[str]:
        """The -D flags kernel.cu reads for a tile config. Masking is the lowered variant's, so
        the reference's own causal switch is off."""

    def compile_options(self, point: dict, head_dim: int, dtype: str) -> list[str]:
        """Every option of compile_cubin but the arch (which is `arch`)."""
        return ["-std=c++17", *self.defines(point, head_dim, check_dtype(dtype)), f"-I{self.directory}"]

    @abstractmethod
    def check_inputs(self, q, k, v) -> None:
        """Raise LaunchError naming the problem and the fix for inputs this kernel cannot run."""

    @abstractmethod
    def launcher(self, lowered, cubin: bytes, point: dict) -> Prepare:
        """prepare(extra, device) -> call(q, k, v, out, lse=None) -> (out, lse) for a lowered
        variant compiled to `cubin` at tile config `point` (head dim and dtype are q's; they must match the cubin's). An
        empty `cubin` builds lowered.source through the compile cache on the first call."""

    @abstractmethod
    def shape_launch(self, cubin: bytes, point: dict, head_dim: int, dtype: str, variant, device,
                     dims: tuple[int, int, int, int, int], scale: float) -> ShapeLaunch:
        """launch(q, k, v, out, lse) at one shape, dims = (B, Hq, Hkv, Nq, Nk), on the current
        stream: the tuned op's path (cubridge.load), built once per shape and called many times.
        `cubin` was compiled with compile_options(point, head_dim, dtype); `variant` is the
        lowered variant's cubridge.lower.Launchable (its packed extra inputs)."""

    def variant_default(self, head_dim: int, seqlen: int, wide: bool | int = False) -> dict:
        """The tile config a lowered variant runs at untuned (cubridge.op.build): the space's first
        measured point; a kernel whose best tile depends on N (or on the variant: `wide`, the
        generator's wide_tile) says so by overriding this."""
        return dict(self.space.best_known(head_dim)[0])

    def copy_reason(self, t) -> str | None:
        """Why the kernel cannot read the [B, H, N, D] view `t` (a real or a traced, fake tensor)
        in place, so that the op copies it to contiguous first; None where it can. Contiguous
        views only, unless the kernel says more."""
        return None if t.is_contiguous() else f"{self.name} reads contiguous [B, H, N, D] only"

    def __repr__(self) -> str:
        return f"<reference kernel {self.name} ({self.arch}, {self.directory})>"


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise CubridgeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}",
                            hint='write "bf16" or "fp16"')
    return dtype


_KERNELS: dict[str, ReferenceKernel] = {}


def register(cls: type[ReferenceKernel]) -> type[ReferenceKernel]:
    """Class decorator: make `cls.name` known. A second class under the same name replaces the
    first (a test may register its own)."""
    _KERNELS[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Forget kernel `name` (a test's own kernel, after the test)."""
    _KERNELS.pop(name, None)


def _builtin_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def reference_kernel(name: str) -> ReferenceKernel:
    """The registered kernel `name`; the built-in ones register when their module is imported."""
    if name not in _KERNELS and name in _builtin_modules():
        importlib.import_module(f"{__name__}.{name}")
    if name not in _KERNELS:
        raise CubridgeError(f"unknown reference kernel {name!r}",
                            hint=f"known reference kernels: {', '.join(kernel_names())}")
    return _KERNELS[name]


def kernel_names() -> list[str]:
    """Every known kernel: the built-in modules of this package and any registered since."""
    for module in _builtin_modules():
        importlib.import_module(f"{__name__}.{module}")
    return sorted(_KERNELS)


def built_head_dims(ref: str) -> tuple[int, ...] | None:
    """Head dims reference kernel `ref` is built for (its tile space's, which the tuner and
    configs use too), or None for a kernel without a space."""
    try:
        return tuple(reference_kernel(ref).space.head_dims)
    except CubridgeError:
        return None


def check_head_dim(ref: str, D: int, where: str | None = None):
    """Refuse a head dim the reference kernel `ref` is not built for (no-op for unknown kernels):
    transfer, verify-ir and lower ask here."""
    built = built_head_dims(ref)
    if built is not None and D not in built:
        raise CubridgeError(f"head dim {D} is not built for {ref}: supported head dims are "
                            f"{', '.join(map(str, built))}", where=where,
                            hint=f"use --head-dim {' or '.join(map(str, built))}, or project q / k / v to one of them")


def fit_params(program, D: int, params: dict | None = None) -> dict:
    """The CuIR params to check and run `program` (a reference kernel's program or a transfer of
    it) at head dim D: `params` when given or when the program's own param(...) defaults pass the
    static check at D; else the kernel's measured default tile at D (its space's first best_known
    point), e.g. fa3_sm90 at D = 256, whose 128 x 128 defaults overflow shared memory there.
    Unknown kernels and unbuilt head dims keep `params` (the check then says what is wrong)."""
    from cubridge.cuir.checker import check
    if params:
        return dict(params)
    try:
        check(program, dims={"D": D})
        return {}
    except CubridgeError:
        pass
    try:
        space = reference_kernel(program.name).space
    except CubridgeError:
        return {}
    if space is None or D not in space.head_dims:
        return {}
    points = [p for p in space.best_known(D) if not space.problems(p, D, space.arches[0])]
    return dict(space.to_cuir(points[0])) if points else {}
