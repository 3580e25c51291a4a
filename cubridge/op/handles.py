"""Tuned ops by handle: the custom ops (cubridge/op/library.py) carry an int naming the TunedOp
in this process, since a torch.library op takes tensors and scalars, not Python objects."""
from __future__ import annotations

import itertools
import weakref

from cubridge.errors import LaunchError

_OPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(op) -> int:
    handle = next(_NEXT)
    _OPS[handle] = op
    return handle


def op_for(handle: int):
    op = _OPS.get(handle)
    if op is None:
        raise LaunchError(f"tuned op #{handle} no longer exists", where="cubridge op",
                          hint="keep the object cubridge.load returned alive while a compiled function uses it")
    return op
