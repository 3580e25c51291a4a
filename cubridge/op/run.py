"""Reading a run directory and checking its arch, without torch (cubridge.load imports this at
`import cubridge`; the op itself, and torch, load on the first cubridge.load call)."""
from __future__ import annotations

import json
from pathlib import Path

from cubridge.errors import CubridgeError, LaunchError

# What a cubin built for an arch runs on: sm_90a only on 9.0; sm_80 SASS on any 8.x.
ARCH_RUNS_ON = {"sm_90a": lambda cap: cap == (9, 0), "sm_80": lambda cap: cap[0] == 8}


def read_run(directory: Path) -> tuple[dict, dict]:
    """(manifest, dispatch) of a run directory, with clear errors for what is missing."""
    d = Path(directory)
    if not (d / "manifest.json").is_file():
        raise CubridgeError("not a cubridge-tune output directory (no manifest.json)", where=str(d),
                            hint="give the output directory of a cubridge-tune run (its config's output:)")
    manifest = json.loads((d / "manifest.json").read_text())
    if not (d / "dispatch.json").is_file():
        raise CubridgeError(f"this run has no tuned kernel (status: {manifest.get('status')}: {manifest.get('message')})",
                            where=str(d), hint="run cubridge-tune on a GPU machine (without --dry-run)")
    return manifest, json.loads((d / "dispatch.json").read_text())


def check_arch(built: str, capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """Raise unless a cubin built for `built` runs on a device of `capability`."""
    runs = ARCH_RUNS_ON.get(built)
    if runs is None or not runs(tuple(capability)):
        raise LaunchError(f"the kernel was built for {built}; {device_name} is sm_{capability[0]}{capability[1]}",
                          where="cubridge.load", hint=f"tune again on this GPU: cubridge-tune CONFIG with arch: "
                                                      f"{'sm_90a' if tuple(capability) == (9, 0) else 'sm_80'}")
