"""Errors that reach users. Every one says where (file, line, field), what, and how to fix it."""
from __future__ import annotations


class CubridgeError(Exception):
    """Base class. `where` is a location ("prog.cuir:12", "configs/x.yaml: search.budget"),
    `hint` says what to do about it."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class SpecError(CubridgeError):
    """A variant spec cannot be loaded or is inconsistent."""


class CuIRError(CubridgeError):
    """Base for CuIR problems; carries the statement line when one is known."""

    def __init__(self, message: str, *, line: int | None = None, source: str | None = None,
                 hint: str | None = None):
        self.line = line
        self.source = source
        where = None
        if source or line is not None:
            where = f"{source or '<cuir>'}:{line}" if line is not None else source
        super().__init__(message, where=where, hint=hint)


class CuIRSyntaxError(CuIRError):
    """The text is not valid CuIR syntax or uses a forbidden construct."""


class CuIRCheckError(CuIRError):
    """The program parses but is ill-formed: shapes, dtypes, memory spaces, waits, barriers."""


class CuIRRuntimeError(CuIRError):
    """The interpreter found a fault: read before wait, deadlock, unwritten output, ..."""


class VerificationError(CubridgeError):
    """A candidate failed the verification rule."""


class BuildError(CubridgeError):
    """A CUDA kernel failed to compile."""


class LaunchError(CubridgeError):
    """Inputs rejected before a kernel launch (shape, dtype, device, contiguity)."""


def env_switch(name: str, default: str, hint: str, error: type[CubridgeError] = LaunchError) -> bool:
    """An on / off environment switch: "1" on, "0" off, unset `default`; any other value raises `error`
    naming the variable (where="environment") with `hint`."""
    import os
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise error(f"{name}={value!r} is neither 0 nor 1", where="environment", hint=hint)
    return value == "1"
