"""The tuner's view of the tile search spaces: `SPACES[name]` is reference kernel `name`'s space
(cubridge.runtime.kernels; each kernel declares its own in its module, cubridge.runtime.space
defines the type).

Example:
    >>> s = SPACES["fa3_sm90"]
    >>> [p.split(":")[0] for p in s.problems({"block_m": 128, "block_n": 256, "stages": 2, "persistent": False},
    ...                                        128, "sm_90a")]
    ['shared memory', 'registers']
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from cubridge.runtime.kernels import kernel_names, reference_kernel
from cubridge.runtime.space import Constraint, Param, Space

__all__ = ["SPACES", "Constraint", "Param", "Space"]


class KernelSpaces(Mapping):
    """name -> Space over the registered reference kernels; an unknown name raises CubridgeError
    listing the known ones."""

    def __getitem__(self, name: str) -> Space:
        return reference_kernel(name).space

    def __iter__(self) -> Iterator[str]:
        return iter(kernel_names())

    def __len__(self) -> int:
        return len(kernel_names())


SPACES = KernelSpaces()
