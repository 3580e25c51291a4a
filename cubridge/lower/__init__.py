"""Lowering: a target CuIR program -> CUDA, by regenerating only the regions of the reference
kernel that the transfer changed (the lifting map), and the launch arguments it needs.

Example:
    >>> from cubridge.cuir.parser import parse_file
    >>> from cubridge.runtime.kernels import reference_kernel
    >>> from cubridge.spec import load_spec
    >>> from cubridge.transfer.rules import transfer
    >>> ref = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    >>> k = lower(transfer(ref, load_spec("prefixlm")).program, "fa3_sm90")
    >>> "mask_pred" in k.source and [f for f, _ in k.fields]
    ['C0']
"""
from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass, field

import torch

from cubridge.cuir import nodes as N
from cubridge.lower.cexpr import LowerError
from cubridge.lower.variant import VariantIR, extract
from cubridge.runtime.kernels import reference_kernel

__all__ = ["LowerError", "LoweredKernel", "Launchable", "lower"]


@dataclass
class LoweredKernel:
    """CUDA source of a variant and the layout of its VariantArgs (field name, C type)."""
    ref: str
    source: str
    fields: list = field(default_factory=list)
    ir: VariantIR | None = None

    def args(self, inputs: dict, device, per_call: bool = False) -> "Launchable":
        """Pack the variant's extra inputs (from Candidate.bind) for a launch on `device`;
        per_call: the inputs follow the call's runtime inputs (see Launchable.per_call)."""
        keep, values = [], {}
        for name, t, nd in (self.ir.tables if self.ir else []):
            x, dtype = inputs[name], torch.int32 if t == "int" else torch.float32
            if not (x.dtype is dtype and x.device == device and x.is_contiguous()):   # per call: 2 torch calls less
                x = x.to(device=device, dtype=dtype).contiguous()
            keep.append(x)
            values[name] = x.data_ptr()
            for d in range(nd):
                values[f"{name}_n{d}"] = x.shape[d]
        for name, _ in (self.ir.scalars if self.ir else []):
            values[name] = inputs[name]
        struct = _struct_type(tuple(self.fields))()
        for name, _ in self.fields:
            setattr(struct, name, values.get(name, 0))
        return Launchable(self.source, struct, keep, per_call=per_call)


@dataclass
class Launchable:
    """A lowered variant ready to launch: its source, its VariantArgs (a ctypes structure with
    the C layout), and the device tensors it points to (kept alive until the launch is done)."""
    source: str
    args: ctypes.Structure
    keep_alive: list
    tile_orders: dict = field(default_factory=dict)   # fa3: longest-first tile order per shape
    # packed for one call only (a spec's runtime inputs): fa3 orders its tiles on the GPU in a few
    # launches (runtime.lpt) instead of lpt_order's ~30 torch calls, which a per-shape launch pays once
    per_call: bool = False
    lpt_sections: bool = field(default_factory=lambda: importlib.import_module("cubridge.runtime.lpt").sections_on())


_CTYPES = {"ptr": ctypes.c_void_p, "int": ctypes.c_int32, "float": ctypes.c_float}
_STRUCTS: dict = {}


def _struct_type(fields: tuple):
    if fields not in _STRUCTS:
        layout = [(n, _CTYPES[t]) for n, t in fields] or [("unused", ctypes.c_int32)]
        _STRUCTS[fields] = type("VariantArgs", (ctypes.Structure,), {"_fields_": layout})
    return _STRUCTS[fields]


def struct_fields(ir: VariantIR) -> list:
    """The VariantArgs layout of a variant: (field name, "ptr" | "int" | "float")."""
    out = []
    for n, _, nd in ir.tables:
        out.append((n, "ptr"))
        out += [(f"{n}_n{d}", "int") for d in range(nd)]
    out += [(n, t) for n, t in ir.scalars]
    return out


def lower(program: N.Program, ref: str) -> LoweredKernel:
    """CUDA source for `program` (a transfer of reference kernel `ref`): the kernel's own region
    generator (ReferenceKernel.generator) patches its kernel.cu."""
    kernel = reference_kernel(ref)
    ir = extract(program)
    generator = importlib.import_module(kernel.generator)
    return LoweredKernel(ref, generator.lower_source(kernel.source(), ir), struct_fields(ir), ir)
