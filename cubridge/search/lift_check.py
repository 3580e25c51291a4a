"""The lift check for a user's kernel: a candidate CuIR program and the user's own kernel run the
same random inputs and must agree within the verification rule (and each pass it against the
spec's float64 golden). It runs as a `lift_check` job on a runner worker, since the user's kernel
runs there (CUDA from outside the project only ever runs in the isolated workers).

The user's kernel is reached through a launcher: a Python file that defines
    launch(q, k, v) -> out        # q [B, Hq, N, D], k / v [B, Hkv, N, D], out like q
doing whatever compilation and launch the kernel needs. The launcher is the user's own code (it is
loaded and run, as their spec file is); model output never is.

Example (CPU, a launcher that is the spec's reference):
    >>> import json
    >>> from cubridge.paths import ref_kernel_dir
    >>> p = {"cuir": (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text(), "spec": "causal",
    ...      "launcher": "cubridge.search.lift_check:reference_launcher", "device": "cpu",
    ...      "params": {"CAUSAL": 1}, "shapes": [[1, 2, 1, 70, 16, 0]]}
    >>> lift_check_job(p)[0].state.value
    'ok'
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch

from cubridge import rule
from cubridge.errors import CubridgeError
from cubridge.vocab import Outcome, TrialState

DEFAULT_SHAPES = ((2, 4, 2, 300, 64, 0), (1, 2, 2, 77, 64, 1), (1, 4, 1, 130, 128, 2))


def reference_launcher(spec_name: str = "causal"):
    """A stand-in 'kernel': the spec's own reference (for tests and for trying the flow)."""
    from cubridge.spec import load_spec
    spec = load_spec(spec_name)
    return lambda q, k, v: spec.run_reference(q, k, v)


def load_launcher(ref: str, spec_name: str):
    """`path/to/launch.py` (its `launch`) or `module:function` (a factory taking the spec name)."""
    if ":" in ref and not ref.endswith(".py"):
        module, fn = ref.split(":", 1)
        return getattr(importlib.import_module(module), fn)(spec_name)
    path = Path(ref)
    if not path.is_file():
        raise CubridgeError(f"launcher {ref} not found", hint="a .py file defining launch(q, k, v) -> out")
    mod_spec = importlib.util.spec_from_file_location(f"cubridge_launcher_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    if not callable(getattr(module, "launch", None)):
        raise CubridgeError(f"{ref} defines no launch(q, k, v)", hint="def launch(q, k, v): ... return out")
    return module.launch


def lift_check_job(p: dict):
    from cubridge.cuir.interp import interpret
    from cubridge.cuir.parser import parse
    from cubridge.spec import load_spec
    from cubridge.verify import Case, make_inputs
    spec = load_spec(p["spec"])
    program = parse(p["cuir"], source="<lifted>")
    launch = load_launcher(p["launcher"], p["spec"])
    device, dtype = p.get("device", "cuda"), torch.bfloat16 if p.get("dtype", "bf16") == "bf16" else torch.float16
    sp = p.get("spec_params") or {}
    rows = []
    for B, Hq, Hkv, N, D, seed in p.get("shapes") or DEFAULT_SHAPES:
        case = Case(B, Hq, Hkv, N, N, D, seed)
        q, k, v = make_inputs(case, dtype)
        golden = spec.run_reference(q.double(), k.double(), v.double(), **sp)
        ref = spec.run_reference(q, k, v, **sp)
        try:
            kernel_out = launch(q.to(device), k.to(device), v.to(device)).to("cpu")
        except Exception as e:  # noqa: BLE001 - the user's kernel failing is this check's outcome
            return Outcome(TrialState.CRASH, f"the kernel's launcher raised at {case}: {type(e).__name__}: {e}"), {}
        try:
            interp_out = interpret(program, {"Q": q, "K": k, "V": v}, params=p.get("params") or {}).outputs["O"]
        except CubridgeError as e:
            return Outcome(TrialState.WRONG_ANSWER, f"the CuIR program fails at {case}: {e}"), {}
        kv, iv = rule.compare(kernel_out, golden, ref), rule.compare(interp_out, golden, ref)
        gap = (kernel_out.double() - interp_out.double()).abs().max().item()
        rows.append({"case": str(case), "kernel": str(kv), "cuir": str(iv), "gap": gap})
        if not kv.passed:
            return Outcome(TrialState.WRONG_ANSWER, f"the kernel itself fails the rule at {case}: {kv.reason}"), \
                {"rows": rows}
        if not iv.passed or gap > kv.bound:
            why = iv.reason if not iv.passed else f"kernel and CuIR differ by {gap:.3e} > {kv.bound:.3e}"
            return Outcome(TrialState.WRONG_ANSWER, f"lift check at {case}: {why}"), {"rows": rows}
    return Outcome(TrialState.OK, f"kernel and CuIR agree at {len(rows)} shapes"), {"rows": rows}


def lift_acceptor(runner, *, launcher: str, spec: str, device: str = "cuda", dtype: str = "bf16",
                  spec_params: dict | None = None, params: dict | None = None, timeout_s: float = 300.0):
    """accept(LiftCandidate) -> Outcome for cubridge.llm.lift.lift: the lift check as a runner job."""
    from cubridge.vocab import Job, Proposal
    from cubridge.search.messages import run_jobs

    def accept(candidate) -> Outcome:
        pid = Proposal(candidate.cuir, "lift").id
        payload = {"candidate": pid, "cuir": candidate.cuir, "launcher": launcher, "spec": spec,
                   "device": device, "dtype": dtype, "spec_params": spec_params or {}, "params": params or {}}
        res = run_jobs(runner, [Job("lift_check", payload, timeout_s, needs_gpu=device == "cuda")])[pid]
        return res.outcome
    return accept
