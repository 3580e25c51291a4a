"""`cubridge.load(DIR)`: the tuned kernel of a `cubridge-tune` output directory, as a callable.

The call picks the config for the sequence length from the dispatch table and refuses, before any
launch, what the kernel was not built for: another GPU architecture, dtype or head dim, CPU
tensors, or Hq not a multiple of Hkv.

Example (on the GPU the run tuned for):
    >>> attn = cubridge.load("out/h100_prefixlm")                     # doctest: +SKIP
    >>> out = attn(q, k, v)       # q [B, Hq, N, D], k/v [B, Hkv, N, D], bf16 on cuda   # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path

from cubridge.errors import CubridgeError, LaunchError
from cubridge.search.artifacts import select_bucket

# What a cubin built for an arch runs on: sm_90a only on 9.0; sm_80 SASS on any 8.x.
ARCH_RUNS_ON = {"sm_90a": lambda cap: cap == (9, 0), "sm_80": lambda cap: cap[0] == 8}
DTYPE_NAMES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def load(directory) -> "TunedKernel":
    d = Path(directory)
    if not (d / "manifest.json").is_file():
        raise CubridgeError("not a cubridge-tune output directory (no manifest.json)", where=str(d),
                            hint="give the output directory of a cubridge-tune run (its config's output:)")
    manifest = json.loads((d / "manifest.json").read_text())
    if not (d / "dispatch.json").is_file():
        raise CubridgeError(f"this run has no tuned kernel (status: {manifest.get('status')}: {manifest.get('message')})",
                            where=str(d), hint="run cubridge-tune on a GPU machine (without --dry-run)")
    return TunedKernel(d, manifest, json.loads((d / "dispatch.json").read_text()))


def check_arch(built: str, capability: tuple[int, int], device_name: str = "this GPU") -> None:
    """Raise unless a cubin built for `built` runs on a device of `capability`."""
    runs = ARCH_RUNS_ON.get(built)
    if runs is None or not runs(tuple(capability)):
        raise LaunchError(f"the kernel was built for {built}; {device_name} is sm_{capability[0]}{capability[1]}",
                          where="cubridge.load", hint=f"tune again on this GPU: cubridge-tune CONFIG with arch: "
                                                      f"{'sm_90a' if tuple(capability) == (9, 0) else 'sm_80'}")


class TunedKernel:
    def __init__(self, directory: Path, manifest: dict, dispatch: dict):
        self.directory, self.manifest, self.dispatch = directory, manifest, dispatch
        self.buckets = dispatch["buckets"]
        self._launchers: dict = {}

    def __repr__(self) -> str:
        d = self.dispatch
        spans = ", ".join((f"N<={b['max_seqlen']}" if b["max_seqlen"] else f"N>{b['min_seqlen'] - 1}") + f": {b['label']}"
                          for b in self.buckets)
        return (f"TunedKernel({d['spec_name']} from {self.buckets[0]['reference']}, {d['arch']} {d['dtype']} "
                f"D={d['head_dim']}; {spans})")

    def select(self, seqlen: int) -> dict:
        """The dispatch-table entry (config, cubin, kernel files) for a sequence length."""
        if seqlen < 1:
            raise LaunchError(f"sequence length {seqlen}", where="cubridge.load", hint="N must be >= 1")
        return select_bucket(self.buckets, seqlen)

    def check(self, q, k, v) -> dict:
        """Refuse what this kernel was not built for; return the chosen entry."""
        import torch
        d = self.dispatch
        usage = f"q [B, Hq, N, {d['head_dim']}], k and v [B, Hkv, N, {d['head_dim']}], {DTYPE_NAMES[d['dtype']]} on cuda"
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise LaunchError(f"{name} must be a 4-d torch.Tensor", where="cubridge.load", hint=usage)
            if str(t.dtype) != DTYPE_NAMES[d["dtype"]]:
                raise LaunchError(f"{name} is {t.dtype}; the kernel was built for {d['dtype']}", where="cubridge.load",
                                  hint=f"convert with .to({DTYPE_NAMES[d['dtype']]}) or tune with dtype: {d['dtype']}")
            if t.shape[-1] != d["head_dim"]:
                raise LaunchError(f"{name} has head dim {t.shape[-1]}; the kernel was built for {d['head_dim']}",
                                  where="cubridge.load", hint="tune a config with this head_dim")
        if q.shape[1] % k.shape[1] or k.shape != v.shape:
            raise LaunchError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need Hq a multiple of Hkv "
                              "and k, v of one shape", where="cubridge.load", hint=usage)
        if not q.is_cuda:
            raise LaunchError(f"q is on {q.device}; the tuned kernel runs on a GPU", where="cubridge.load", hint=usage)
        check_arch(d["arch"], torch.cuda.get_device_capability(q.device), torch.cuda.get_device_name(q.device))
        return self.select(q.shape[2])

    def __call__(self, q, k, v):
        entry = self.check(q, k, v)
        return self._launcher(entry)(q, k, v)

    def _launcher(self, entry: dict):
        key = (entry["candidate"], entry["label"])
        if key not in self._launchers:
            self._launchers[key] = _make_launcher(self.directory, self.dispatch, entry)
        return self._launchers[key]


def _make_launcher(directory: Path, dispatch: dict, entry: dict):
    """fn(q, k, v) -> out: the lowered kernel launched as the tuner timed it, with the spec's extra
    inputs bound per call (the spec is the run's copy, spec.py)."""
    import torch

    from cubridge.search.jobs import binder_for, lower_kernel, lowering
    from cubridge.search.measure import launcher
    from cubridge.search.space import SPACES
    if lowering() is None:
        raise LaunchError("this checkout has no cubridge.lower: it cannot launch a lowered kernel",
                          where="cubridge.load", hint="the CUDA source and cubin are in the output directory")
    text = (directory / entry["cuir"]).read_text()
    p = {"text": text, "candidate": entry["candidate"], "reference": entry["reference"], "config": entry["config"],
         "head_dim": dispatch["head_dim"], "dtype": dispatch["dtype"], "origin": entry["origin"],
         "spec": str(directory / dispatch["spec"]), "spec_params": dispatch["spec_params"]}
    lowered, _ = lower_kernel(p)
    cubin = (directory / entry["cubin"]).read_bytes() if entry.get("cubin") else b""
    prepare = launcher(p, lowered, cubin)
    if prepare is None:
        raise LaunchError("this checkout's lowering cannot launch a kernel", where="cubridge.load")
    cuir = SPACES[entry["reference"]].to_cuir(entry["config"])
    bind = binder_for(p)

    def run(q, k, v):
        B, Hq, N, _ = q.shape
        extra = {} if bind is None else bind(Nq=N, Nk=k.shape[2], Hq=Hq, Hkv=k.shape[1], B=B, params=cuir,
                                             device=q.device)
        extra = {n: x.to(q.device) if isinstance(x, torch.Tensor) else x for n, x in extra.items()}
        out = torch.empty_like(q)
        prepare(extra, q.device)(q, k, v, out)
        return out
    return run
