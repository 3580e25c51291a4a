"""Command line: `cubridge <subcommand>` and `cubridge-tune CONFIG`.

    cubridge verify-ir fa2_sm80 --spec causal           # interpreter check, table of cases
    cubridge check-ir ref_kernels/fa3_sm90/kernel.cuir --head-dim 128
    cubridge print-ir fa2_sm80                          # canonical CuIR text
    cubridge analyze fa2_sm80 --spec causal --shape 1,4,2,512,64
    cubridge specs [NAME]                               # list specs, or show one with its mask
    cubridge transfer prefixlm --ref fa3_sm90           # target CuIR (rules) + verification table
    cubridge lower prefixlm --ref fa3_sm90 --out v.cu   # the lowered CUDA (regions regenerated)
    cubridge tune configs/h100_prefixlm.yaml --dry-run  # same as cubridge-tune (configs/README.md)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cubridge.errors import CubridgeError
from cubridge.vocab import DTYPES


# One vocabulary with configs/*.yaml (dtype: bf16 | fp16; shapes.head_dim defaults to 128 in every
# shipped config and model preset).
HEAD_DIM = 128
DTYPE_NAMES = DTYPES


def _dtype(text: str) -> str:
    return {"f16": "fp16", "float16": "fp16", "bfloat16": "bf16"}.get(text, text)    # old spellings still read


def _program(arg: str):
    from cubridge.cuir.parser import parse_file
    from cubridge.runtime.kernels import reference_kernel
    path = Path(arg)
    if not path.exists() and "/" not in arg and not arg.endswith(".cuir"):
        path = reference_kernel(arg).cuir_path()
    return parse_file(path)


def _params(items) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise CubridgeError(f"--param {item!r} is not NAME=VALUE", hint="e.g. --param BLOCK_M=64")
        k, v = item.split("=", 1)
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                raise CubridgeError(f"--param {k}: {v!r} is not a number") from None
    return out


def _spec_params(items) -> dict:
    out = {}
    for item in items or []:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise CubridgeError(f"{item!r} is not NAME=VALUE", where="--spec-param", hint="e.g. --spec-param prefix=512")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                raise CubridgeError(f"{k}: {v!r} is not a number", where="--spec-param",
                                    hint=f"e.g. --spec-param {k}=512") from None
    return out


def _head_dims(ref: str, dims, where: str, program=None, note: bool = True):
    """Head dims the reference kernel is not built for (cubridge.runtime.kernels.built_head_dims): refused
    outright without `program`; with it, refused where its static check fails there but passes
    at a built head dim (the shared-memory overflow would hide the reason), else noted on stderr
    (the interpreter verifies the CuIR at any D; lower --compile refuses it)."""
    from cubridge.cuir.checker import check
    from cubridge.runtime.kernels import built_head_dims, check_head_dim, fit_params

    def passes(D):
        try:
            check(program, params=fit_params(program, D), dims={"D": D})
            return True
        except CubridgeError:
            return False
    for D in sorted(dims):
        try:
            check_head_dim(ref, D, where=where)
        except CubridgeError as e:
            if program is None or (not passes(D) and any(passes(d) for d in built_head_dims(ref))):
                raise
            if note:
                print(f"note: {e.message}; the interpreter checks the CuIR only, lower --compile refuses it",
                      file=sys.stderr)


def _shape(text: str, flag: str) -> tuple[int, int, int, int, int]:
    """B,Hq,Hkv,N,D: five positive integers with Hq a multiple of Hkv."""
    parts = text.split(",")
    try:
        vals = tuple(int(x) for x in parts)
    except ValueError:
        vals = ()
    if len(vals) != 5 or min(vals) < 1:
        raise CubridgeError(f"{text!r} is not five positive integers B,Hq,Hkv,N,D", where=flag,
                            hint=f"e.g. {flag} 1,8,2,1024,128")
    if vals[1] % vals[2]:
        raise CubridgeError(f"Hq = {vals[1]} is not a multiple of Hkv = {vals[2]}", where=flag,
                            hint="GQA / MQA need Hq = G * Hkv")
    return vals


def cmd_verify_ir(a) -> int:
    from cubridge.spec import load_spec
    from cubridge.verify import Case, default_cases, verify_program
    prog, spec = _program(a.program), load_spec(a.spec)
    spec.resolved_params(**_spec_params(a.spec_param))      # names and types, before any case runs
    cases = default_cases(a.head_dim, quick=a.quick)
    if a.shape:
        B, Hq, Hkv, N, D = _shape(a.shape, "--shape")
        cases = [Case(B, Hq, Hkv, N, N, D, s) for s in range(a.seeds)]
    _head_dims(prog.name, {c.D for c in cases}, "--shape" if a.shape else "--head-dim", program=prog)
    report = verify_program(prog, spec, params=_params(a.param), cases=cases, dtype=a.dtype,
                            spec_params=_spec_params(a.spec_param))
    print(report.table())
    return 0 if report.passed else 1


def cmd_check_ir(a) -> int:
    from cubridge.cuir.checker import check
    prog = _program(a.program)
    from cubridge.search.space import SPACES
    _head_dims(prog.name, {a.head_dim}, "--head-dim", program=prog)
    from cubridge.runtime.kernels import fit_params
    r = check(prog, params=fit_params(prog, a.head_dim, _params(a.param)), dims={"D": a.head_dim})
    space = SPACES.get(prog.name)
    # The CuIR may hold at any D, but the reference kernel is built for a few head dims only: "ok"
    # at another would say more than is true (configs and the tuner refuse it).
    unbuilt = space is not None and a.head_dim not in space.head_dims
    status = (f"CuIR ok, but NOT BUILDABLE: the {prog.name} kernel builds head dims "
              f"{', '.join(map(str, space.head_dims))} only" if unbuilt else "ok")
    print(f"{prog.name}: {status} (D={a.head_dim}; " + ", ".join(f"{k}={v}" for k, v in r.params.items()) + ")")
    print("roles: " + ", ".join(f"{n} x{c} ({w} warps)" for n, w, c in r.roles) if r.roles else "roles: none")
    print(f"shared memory: {r.smem_bytes} B (" + ", ".join(f"{k} {v}" for k, v in r.buffers.items()) + ")")
    return 1 if unbuilt else 0


def cmd_print_ir(a) -> int:
    from cubridge.cuir.printer import to_text
    sys.stdout.write(to_text(_program(a.program)))
    return 0


def cmd_analyze(a) -> int:
    from cubridge.analysis import analyze
    from cubridge.spec import load_spec
    from cubridge.verify import Case
    B, Hq, Hkv, N, D = _shape(a.shape, "--shape")
    spec = load_spec(a.spec) if a.spec else None
    if N >= ANALYZE_SAYS_FROM:
        print(f"analyze: interpreting every tile on the CPU at N={N}: minutes (4 at 8k, fa3_sm90, one core); "
              f"progress every {ANALYZE_PROGRESS_S:.0f} s", file=sys.stderr, flush=True)
    print(analyze(_program(a.program), Case(B, Hq, Hkv, N, N, D), params=_params(a.param), spec=spec,
                  spec_params=_spec_params(a.spec_param), progress=_progress_printer()).table())
    return 0


# `analyze` at 8k ran 4 minutes without a word (issue 20): it says so up front from 4k and
# reports blocks done every ANALYZE_PROGRESS_S.
ANALYZE_SAYS_FROM = 4096
ANALYZE_PROGRESS_S = 10.0


def _progress_printer(clock=None):
    import time
    clock = clock or time.monotonic
    start = last = clock()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = clock()
        if now - last >= ANALYZE_PROGRESS_S:
            last = now
            left = (now - start) / done * (total - done)
            print(f"analyze: {done}/{total} blocks interpreted ({now - start:.0f} s, about {left:.0f} s left)",
                  file=sys.stderr, flush=True)
    return report


def cmd_specs(a) -> int:
    from cubridge.spec import builtin_specs, load_spec
    if not a.name:
        for name in builtin_specs():
            s = load_spec(name)
            print(f"{name:<22} {(s.doc or '').strip().splitlines()[0] if s.doc else ''}")
        return 0
    s = load_spec(a.name)
    print(repr(s))
    print(s.picture(N=a.n))
    return 0


def cmd_transfer(a) -> int:
    from cubridge import gate
    from cubridge.cuir.parser import parse_file
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    from cubridge.transfer.rules import transfer
    from cubridge.verify import default_cases, verify_transfer
    out = gate.check_out_path(a.out)
    ref = parse_file(reference_kernel(a.ref).cuir_path())
    _transfer_head_dims(a, ref)
    spec = load_spec(a.spec)
    spec.resolved_params(**_spec_params(a.spec_param))
    cand = transfer(ref, spec, spec_params=_spec_params(a.spec_param))
    for note in _trace_notes(spec, a):
        print(f"note: {note}", file=sys.stderr)
    report = None
    if not a.no_verify:
        report = verify_transfer(ref, spec, params=_params(a.param), cases=default_cases(a.head_dim, quick=a.quick),
                                 spec_params=_spec_params(a.spec_param))
    if out:
        # Verified before it is written: a failing program never lands in a file unmarked.
        problems = gate.static_problems(cand.program, a.head_dim) + (gate.report_problems(report) if report else [])
        if report and not report.passed:
            print(report.table())
        header = gate.refuse_or_header(problems, force=a.force, what=str(out), comment="#")
        if not header and report is None:      # checked but, on request, not verified: say so in the file
            header = gate.warning_header(["verification skipped (--no-verify)"], "#", why="--no-verify")
        gate.write_out(out, header + cand.text)
        print(f"wrote {out}" + (" (with a NOT VERIFIED warning header)" if header else ""))
    else:
        sys.stdout.write(cand.text)
    print(f"# rules applied: {', '.join(cand.rules)}")
    B, Hq, Hkv, N, D = _shape(a.shape, "--shape")
    from cubridge.runtime.kernels import fit_params
    extra = cand.bind(Nq=N, Nk=N, Hq=Hq, Hkv=Hkv, B=B, params=fit_params(cand.program, D, _params(a.param)))
    if extra:
        print(f"# extra inputs at N={N}, Hq={Hq}: " + ", ".join(
            f"{k} = {v}" if not hasattr(v, "shape") else f"{k} {list(v.shape)}" for k, v in extra.items()))
    if report is None:
        return 0
    if not (out and not report.passed):
        print(report.table())
    return 0 if report.passed else 1


def _transfer_head_dims(a, ref) -> None:
    """A head dim the reference kernel is not built for is refused (exit 2, naming the built ones):
    the transfer would verify in the interpreter, which runs CuIR at any D, and then nothing could
    lower or tune it. --force goes on with a note (to study the CuIR at that D)."""
    from cubridge.runtime.kernels import check_head_dim
    dims = {a.head_dim, _shape(a.shape, "--shape")[4]}
    if a.force:
        _head_dims(a.ref, dims, "--head-dim / --shape", program=ref, note=True)
        return
    for D in sorted(dims):
        try:
            check_head_dim(a.ref, D, where="--head-dim / --shape")
        except CubridgeError as e:
            raise CubridgeError(e.message, where=e.where, hint=f"{e.hint}; --force transfers and verifies the "
                                                               "CuIR at this head dim anyway") from None


def _trace_notes(spec, a) -> list[str]:
    """What the tracer took as something not bit-identical (an approx::tanh as exact tanh)."""
    from cubridge.transfer.trace import trace_mask, trace_score
    B, Hq, Hkv, N, D = _shape(a.shape, "--shape")
    hooks = spec.hooks_for(N, N, Hq, Hkv, **_spec_params(a.spec_param))
    notes = trace_mask(hooks.mask_mod).notes if hooks.mask_mod else []
    return notes + (trace_score(hooks.score_mod).notes if hooks.score_mod else [])


def cmd_lower(a) -> int:
    import shutil

    from cubridge import gate
    from cubridge.cuir.parser import parse_file
    from cubridge.lower import lower
    from cubridge.runtime.build import compile_cubin
    from cubridge.runtime.kernels import reference_kernel
    from cubridge.spec import load_spec
    out = gate.check_out_path(a.out)
    if a.compile:       # nvcc would stop at the kernel's static_assert: say it here, plainly
        _head_dims(a.ref, {a.head_dim}, "--head-dim")
    target = Path(a.target)
    ref_program = parse_file(reference_kernel(a.ref).cuir_path())
    spec_params = _spec_params(a.spec_param)
    if target.suffix == ".cuir":
        program, what = parse_file(target), str(target)
        spec = load_spec(a.spec) if a.spec else None
    else:
        spec, what = load_spec(a.target), f"spec {a.target} (rules transfer)"
    if spec is not None:
        spec.resolved_params(**spec_params)
    if target.suffix != ".cuir":      # a spec: transfer it first with the rules proposer
        from cubridge.transfer.rules import transfer
        program = transfer(ref_program, spec, spec_params=spec_params).program
    # The step before lowering: the static check and the verification against the spec.
    problems = gate.static_problems(program, a.head_dim)
    if not problems and spec is None:
        problems = [f"not verified: {a.target} names no spec (pass --spec SPEC, the spec it implements)"]
    elif not problems:
        problems = gate.report_problems(gate.verify_target(program, spec, ref_program=ref_program,
                                                           spec_params=spec_params, head_dim=a.head_dim,
                                                           quick=a.quick))
    header = gate.refuse_or_header(problems, force=a.force, what=f"the CUDA of {what}", comment="//")
    if header:
        print(header.rstrip(), file=sys.stderr)
    kernel = lower(program, a.ref)
    source = header + kernel.source
    if out:
        gate.write_out(out, source)
        print(f"wrote {out}: {what} lowered onto {a.ref}", file=sys.stderr)
    else:
        sys.stdout.write(source)
    fields = ", ".join(f"{n}: {t}" for n, t in kernel.fields) or "none"
    print(f"VariantArgs fields: {fields}", file=sys.stderr)
    if not a.compile:
        return 0
    if shutil.which("nvcc") is None:
        raise CubridgeError("--compile needs nvcc on PATH", hint="install the CUDA toolkit or drop --compile")
    ref = reference_kernel(a.ref)
    point = ref.space.best_known(a.head_dim)[0]          # the kernel's measured default tiles
    options = [*ref.compile_options(point, a.head_dim, "bf16"), "--resource-usage"]
    result = compile_cubin(kernel.source, arch=ref.arch, options=options, compiler="nvcc", use_cache=False)
    report = [ln.strip() for ln in result.log.splitlines() if "registers" in ln or "spill" in ln]
    print(f"compiled for {ref.arch} at {ref.space.label(point)}, D={a.head_dim}, bf16", file=sys.stderr)
    print("\n".join(report[-4:]), file=sys.stderr)
    return 0


def cmd_lift(a) -> int:
    """Lift a user's CUDA kernel into CuIR with a local LLM; accepted only after the lift check
    (the kernel, through the user's launcher, and the CuIR agree) on a runner worker."""
    import torch
    from cubridge.llm.lift import lift
    from cubridge.llm.options import parse_options
    from cubridge.llm.proposer import make_backend
    from cubridge.search.lift_check import lift_acceptor
    from cubridge.search.runners import make_runner
    from cubridge.spec import load_spec
    if a.device == "cuda" and not torch.cuda.is_available():
        raise CubridgeError("the lift check runs your kernel: it needs a CUDA GPU",
                            hint="run on a GPU machine, or --device cpu for a launcher that runs on CPU")
    spec = load_spec(a.spec)
    options = {k: _literal(v) for k, v in (item.partition("=")[::2] for item in a.llm_option or [])}
    backend = make_backend(a.llm, parse_options(a.llm, options))
    out = Path(a.out)
    runner = make_runner("local")
    try:
        accept = lift_acceptor(runner, launcher=a.launcher, spec=a.spec, device=a.device)
        sol = lift(Path(a.kernel).read_text(), backend, accept, out_dir=out.parent / f"{out.stem}_llm",
                   name=a.name or Path(a.kernel).stem, arch=a.arch, spec=spec)
    finally:
        runner.close()
    for r in sol.records:
        print(f"  {r.state.value}: {(r.reason or '').splitlines()[0] if r.reason else ''}")
    if not sol.accepted:
        print("no lifted program passed the lift check", file=sys.stderr)
        return 1
    out.write_text(sol.candidate.cuir)
    out.with_suffix(".cu").write_text(sol.candidate.annotated)
    print(f"wrote {out} (CuIR) and {out.with_suffix('.cu')} (the kernel with its region markers)")
    return 0


def _literal(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _version() -> str:
    from cubridge import __version__
    return f"cubridge {__version__}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cubridge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)

    def program_cmd(name, fn, help_):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("program", help="a .cuir file, or a reference kernel name (fa2_sm80, fa3_sm90)")
        sp.add_argument("--param", action="append", metavar="NAME=VALUE", help="override a param(...)")
        sp.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"default {HEAD_DIM}, as in configs")
        sp.set_defaults(fn=fn)
        return sp

    v = program_cmd("verify-ir", cmd_verify_ir, "verify a CuIR program against a spec in the interpreter")
    v.add_argument("--spec", required=True, help="a spec name (causal, prefixlm, ...) or a .py file")
    v.add_argument("--spec-param", action="append", metavar="NAME=VALUE")
    v.add_argument("--dtype", default="bf16", type=_dtype, choices=list(DTYPE_NAMES),
                   help="bf16 or fp16, as in configs")
    v.add_argument("--quick", action="store_true", help="three cases instead of six")
    v.add_argument("--shape", help="B,Hq,Hkv,N,D: one shape instead of the default set")
    v.add_argument("--seeds", type=int, default=2)
    program_cmd("check-ir", cmd_check_ir, "static checks and shared-memory footprint")
    program_cmd("print-ir", cmd_print_ir, "print the canonical text of a program")
    an = program_cmd("analyze", cmd_analyze, "FLOPs, bytes and KV tiles executed at one shape")
    an.add_argument("--shape", required=True, help="B,Hq,Hkv,N,D")
    an.add_argument("--spec", help="count useful FLOPs from this spec's mask")
    an.add_argument("--spec-param", action="append", metavar="NAME=VALUE")
    t = sub.add_parser("transfer", help="transfer a reference kernel's CuIR to a spec (rules), print it and verify it")
    t.add_argument("spec", help="a spec name or a .py file")
    t.add_argument("--ref", default="fa3_sm90", help="reference kernel (fa2_sm80, fa3_sm90)")
    t.add_argument("--shape", default="1,4,2,1000,64", help="B,Hq,Hkv,N,D at which to show the extra inputs")
    t.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="a tile param (BLOCK_M=64) for the verification cases and the extra inputs shown")
    t.add_argument("--spec-param", action="append", metavar="NAME=VALUE")
    t.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head dim of the verification cases")
    t.add_argument("--quick", action="store_true")
    t.add_argument("--no-verify", action="store_true")
    t.add_argument("--out", help="write the target CuIR here (only once verified) instead of printing it")
    t.add_argument("--force", action="store_true", help="write --out even if it fails, under a warning header; "
                                                        "transfer at a head dim the kernel is not built for")
    t.set_defaults(fn=cmd_transfer)
    lo = sub.add_parser("lower", help="write the CUDA of a target CuIR program (or of a spec's rules transfer)")
    lo.add_argument("target", help="a target .cuir file (e.g. from `cubridge transfer --out`), or a spec")
    lo.add_argument("--ref", default="fa3_sm90", help="reference kernel to patch (fa2_sm80, fa3_sm90)")
    lo.add_argument("--out", help="write the CUDA here (default: stdout)")
    lo.add_argument("--spec-param", action="append", metavar="NAME=VALUE")
    lo.add_argument("--spec", help="the spec a .cuir target implements (it is verified against it first)")
    lo.add_argument("--quick", action="store_true", help="verify on three cases instead of six")
    lo.add_argument("--force", action="store_true", help="lower even if unverified or failing, under a warning header")
    lo.add_argument("--compile", action="store_true", help="also compile it with nvcc and show registers / spills")
    lo.add_argument("--head-dim", type=int, default=HEAD_DIM)
    lo.set_defaults(fn=cmd_lower)
    li = sub.add_parser("lift", help="lift your CUDA attention kernel into CuIR with a local LLM (checked on GPU)")
    li.add_argument("kernel", help="your kernel's .cu file")
    li.add_argument("--launcher", required=True, help="a .py file defining launch(q, k, v) -> out for your kernel")
    li.add_argument("--spec", required=True, help="what the kernel computes (a spec name or file)")
    li.add_argument("--llm", required=True, choices=["openai", "vllm"], help="the model backend")
    li.add_argument("--llm-option", action="append", metavar="KEY=VALUE",
                    help="backend options, e.g. base_url=http://127.0.0.1:8000/v1 or model=/models/coder")
    li.add_argument("--out", default="lifted.cuir", help="where the accepted CuIR goes (and the marked .cu beside it)")
    li.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    li.add_argument("--name", help="the kernel's name in the prompt (default: the file stem)")
    li.add_argument("--arch", default="sm_80")
    li.set_defaults(fn=cmd_lift)
    s = sub.add_parser("specs", help="list the built-in variant specs, or show one")
    s.add_argument("name", nargs="?")
    s.add_argument("-n", type=int, default=24, help="size of the mask picture")
    s.set_defaults(fn=cmd_specs)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:            # `cubridge tune CONFIG` == `cubridge-tune CONFIG`
        return tune_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CubridgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def tune_main(argv=None) -> int:
    """`cubridge-tune CONFIG`: tune a variant (see configs/README.md). Exit 0: tuned (or screened
    with --dry-run); 1: nothing tuned (no candidate verified, no GPU, no trial timed); 2: bad config."""
    p = argparse.ArgumentParser(prog="cubridge-tune", description=tune_main.__doc__)
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("config", help="a YAML config (configs/h100_prefixlm.yaml) or a plan of runs (configs/nightly.yaml)")
    p.add_argument("--dry-run", action="store_true", help="screen (and compile) the population, time nothing")
    p.add_argument("--resume", action="store_true", help="continue the run in the output directory")
    p.add_argument("--out", help="output directory (default: the config's output)")
    p.add_argument("--trials", type=int, help="trial budget (overrides budget.trials)")
    p.add_argument("--runner", choices=["local", "ray", "replay"], help="overrides runner.kind")
    p.add_argument("--replay", help="recorded results (JSON) for --runner replay")
    p.add_argument("--address", help="Ray cluster address for --runner ray (default: a local instance)")
    loud = p.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_true", help="also log every trial as it finishes")
    loud.add_argument("-q", "--quiet", action="store_true", help="only warnings and the exit status; no progress line")
    a = p.parse_args(argv)
    import logging

    from cubridge.config import load_plan, with_overrides
    from cubridge.search.progress import Progress, logging_for_run
    from cubridge.search.tuner import tune
    say = logging.getLogger("cubridge.tune").info
    with logging_for_run(verbose=a.verbose, quiet=a.quiet) as handler:
        try:
            plan = [with_overrides(c, output=a.out if a.out else None, trials=a.trials, runner=a.runner,
                                   replay=a.replay, address=a.address) for c in load_plan(a.config)]
            if a.out and len(plan) > 1:
                plan = [with_overrides(c, output=str(Path(a.out) / c.name)) for c in plan]
            codes = []
            for cfg in plan:
                progress = None if a.quiet else Progress(cfg.budget.trials, label=f"tune {cfg.name}")
                handler.progress = progress
                result = tune(cfg, resume=a.resume, dry_run=a.dry_run, progress=progress, say=say)
                codes.append(result.exit_code)
        except CubridgeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if len(plan) > 1:
        print(f"{sum(c == 0 for c in codes)}/{len(plan)} runs succeeded", file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
