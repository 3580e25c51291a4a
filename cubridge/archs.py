"""Which GPU a cubin's target runs on; no torch import, so `import cubridge` stays light.

Example:
    >>> check_arch("sm_80", (8, 6))
    >>> check_arch("sm_90a", (8, 0), "NVIDIA A100")
    Traceback (most recent call last):
    ...
    cubridge.errors.LaunchError: cubridge.load: the kernel was built for sm_90a; NVIDIA A100 is sm_80
      hint: tune again on this GPU: cubridge-tune CONFIG with arch: sm_80
"""
from __future__ import annotations

from cubridge.errors import LaunchError

# What a cubin built for an arch runs on: sm_90a only on 9.0; sm_80 SASS on any 8.x.
ARCH_RUNS_ON = {"sm_90a": lambda cap: cap == (9, 0), "sm_80": lambda cap: cap[0] == 8}


def check_arch(built: str, capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """Raise unless a cubin built for `built` runs on a device of `capability`."""
    runs = ARCH_RUNS_ON.get(built)
    if runs is None or not runs(tuple(capability)):
        raise LaunchError(f"the kernel was built for {built}; {device_name} is sm_{capability[0]}{capability[1]}",
                          where="cubridge.load", hint=f"tune again on this GPU: cubridge-tune CONFIG with arch: "
                                                      f"{'sm_90a' if tuple(capability) == (9, 0) else 'sm_80'}")
