"""What the CLI may write: a program reaches `cubridge lower` or `transfer --out` only after its
static check and its verification pass (README: verification is the step before lowering).

`--force` writes a failing or unverified program anyway, under a warning header that says what
failed, so the file itself cannot be mistaken for a verified one. Output paths are checked before
any work, so a bad `--out` is an `error: --out: ...` and exit 2, never a traceback.

Example:
    >>> warning_header(["verification failed: max err 1.0 exceeds bound 0.1"], "//").splitlines()[0]
    '// WARNING: NOT VERIFIED - written with --force; do not use this for results.'
"""
from __future__ import annotations

import os
from pathlib import Path

from cubridge.errors import CubridgeError, VerificationError


def check_out_path(path: str | None, flag: str = "--out") -> Path | None:
    """The output file `path`, refused early if it is a directory or its folder is not writable."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise CubridgeError(f"{path} is a directory, not a file", where=flag, hint=f"give {flag} a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CubridgeError(f"folder {parent} does not exist", where=flag, hint="create it first, or write elsewhere")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CubridgeError(f"{path} is not writable", where=flag, hint="choose a path you can write")
    return p


def write_out(path: Path, text: str, flag: str = "--out") -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise CubridgeError(f"cannot write {path}: {e.strerror}", where=flag, hint="choose a path you can write") from None


def warning_header(problems: list[str], comment: str, why: str = "--force") -> str:
    lines = [f"WARNING: NOT VERIFIED - written with {why}; do not use this for results."]
    lines += [f"  {p}" for p in problems]
    return "".join(f"{comment} {ln}\n" for ln in lines)


def report_problems(report) -> list[str]:
    """Why a verification report does not pass (empty when it does)."""
    if report.passed:
        return []
    bad = report.first_failure
    if bad is None:
        return ["verification ran no case"]
    n = sum(not r.passed for r in report.results)
    why = bad.error or bad.verdict.reason
    return [f"verification failed on {n}/{len(report.results)} case(s) against spec {report.spec}; "
            f"first at {bad.case}: {why}"]


def refuse_or_header(problems: list[str], *, force: bool, what: str, comment: str) -> str:
    """'' when there is no problem; the warning header under --force; else a VerificationError
    (exit 2) saying what failed and how to proceed."""
    if not problems:
        return ""
    if force:
        return warning_header(problems, comment)
    raise VerificationError(f"refusing to write {what}: " + "; ".join(problems),
                            hint="fix the program (see `cubridge verify-ir`), or pass --force to write it "
                                 "with a warning header")


def static_problems(program, head_dim: int) -> list[str]:
    from cubridge.cuir.checker import check
    try:
        check(program, dims={"D": head_dim})
    except CubridgeError as e:
        return [f"static check failed: {str(e).splitlines()[0]}"]
    return []


def verify_target(program, spec, *, ref_program, spec_params: dict, head_dim: int, quick: bool):
    """Verify a target program (e.g. a `transfer --out` file) against `spec`. When the program is
    the rules transfer of `spec` onto the reference, its extra inputs are bound the same way."""
    from cubridge.cuir.printer import to_text
    from cubridge.transfer.rules import transfer
    from cubridge.verify import default_cases, verify_program
    binder = None
    try:
        cand = transfer(ref_program, spec, spec_params=spec_params)
        if to_text(cand.program) == to_text(program):
            binder = (lambda c: cand.bind(Nq=c.Nq, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B))
    except CubridgeError:
        pass     # not a rules transfer: it is verified with Q, K, V alone
    return verify_program(program, spec, cases=default_cases(head_dim, quick=quick), spec_params=spec_params,
                          binder=binder)
