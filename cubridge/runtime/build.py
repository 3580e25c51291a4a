"""Compile CUDA C++ to a cubin with nvcc or NVRTC, through an on-disk cache.

The cache key is sha256 over (source text, options, arch, compiler and its version), so editing a
kernel, changing a -D, or upgrading the compiler all miss; identical requests from several
processes share one file (written atomically). A failed compile raises BuildError carrying the
compiler's log.

Example (needs nvcc on PATH; no GPU):
    >>> src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }'
    >>> cubin = compile_cubin(src, arch="sm_80", compiler="nvcc").cubin   # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cubridge.errors import BuildError

COMPILERS = ("nvcc", "nvrtc")
DEFAULT_CACHE_DIR = Path("~/.cache/cubridge/kernels")
CACHE_ENV = "CUBRIDGE_CACHE_DIR"       # the one override of where every cubin is cached
_ARCH_RE = re.compile(r"^sm_\d+a?$")
_NVCC_TIMEOUT_S = 600


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    key: str            # cache key (sha256 hex)
    log: str            # compiler output (warnings, --resource-usage), "" when served from cache
    cached: bool        # True when the cubin came from the disk cache

    def __repr__(self) -> str:
        return f"CompileResult(key={self.key[:12]}…, {len(self.cubin)} bytes, cached={self.cached})"


def cache_key(source: str, options: Sequence[str], arch: str, compiler: str, compiler_version: str) -> str:
    """sha256 hex digest of everything that determines the cubin. Option order is kept: for a
    compiler, `-DA=1 -DA=2` and `-DA=2 -DA=1` differ."""
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch, compiler, compiler_version):
        h.update(part.encode())
        h.update(b"\x1f")   # field separator: ("ab", "c") and ("a", "bc") must not collide
    return h.hexdigest()


def _included_headers(options: Sequence[str]) -> str:
    """The text of the headers in every -I directory: an edited header must not hit a stale cubin."""
    parts = []
    for opt in options:
        if opt.startswith("-I") and Path(opt[2:]).is_dir():
            for f in sorted(Path(opt[2:]).glob("*.cuh")) + sorted(Path(opt[2:]).glob("*.h")):
                parts.append(f"\0{f.name}\0{f.read_text()}")
    return "".join(parts)


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` when given (tests), else $CUBRIDGE_CACHE_DIR, else ~/.cache/cubridge/kernels:
    one cache for the CLI, the runtime, the tuner's workers and cubridge.load, so a cubin built
    once (screening, a trial, the bench) is never built again."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(chosen).expanduser()


def check_arch(arch: str) -> None:
    if not _ARCH_RE.match(arch):
        raise BuildError(f"arch {arch!r} is not a real architecture",
                         hint="use the form 'sm_80', 'sm_90' (or 'sm_90a')")


def default_compiler() -> str:
    """nvcc where it is on PATH (the toolkit's own optimiser flags, what CI compiles with), else
    NVRTC (a GPU box with the driver and the pip NVRTC library but no toolkit)."""
    return "nvcc" if shutil.which("nvcc") else "nvrtc"


def available_compiler() -> str | None:
    """default_compiler() where it can run on this machine, else None (no nvcc, no NVRTC)."""
    compiler = default_compiler()
    if compiler == "nvrtc":
        try:
            _nvrtc()
        except BuildError:
            return None
    return compiler


NO_COMPILER = ("no CUDA compiler here: nvcc is not on PATH and NVRTC is not importable; install the CUDA "
               "toolkit, or cupy-cuda13x with the NVRTC library (pip package nvidia-cuda-nvrtc)")


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str) -> str:
    """A string naming the compiler build, part of the cache key."""
    if compiler == "nvcc":
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise BuildError("nvcc not found on PATH", hint="install the CUDA toolkit or use compiler='nvrtc'")
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
        m = re.search(r"release [\d.]+, (V[\d.]+)", out)
        return f"nvcc {m.group(1) if m else out.strip().splitlines()[-1]}"
    if compiler == "nvrtc":
        major, minor = _nvrtc().getVersion()
        return f"nvrtc {major}.{minor}"
    raise BuildError(f"unknown compiler {compiler!r}", hint=f"choose one of {COMPILERS}")


def compile_cubin(source: str, *, arch: str, options: Sequence[str] = (), compiler: str = "nvcc",
                  cache_dir: str | os.PathLike | None = None, use_cache: bool = True,
                  name: str = "kernel.cu") -> CompileResult:
    """Compile `source` for `arch` (e.g. "sm_90") into a cubin.

    `options` are the flags both compilers understand (-D..., -std=c++17, -I...); the arch flag and
    the output mode are added here. The disk cache lives in resolve_cache_dir(cache_dir)."""
    check_arch(arch)
    if compiler not in COMPILERS:
        raise BuildError(f"unknown compiler {compiler!r}", hint=f"choose one of {COMPILERS}")
    options = tuple(options)
    key = cache_key(source + _included_headers(options), options, arch, compiler, compiler_version(compiler))
    path = resolve_cache_dir(cache_dir) / f"{key}.cubin"
    build = _compile_nvcc if compiler == "nvcc" else _compile_nvrtc
    if not use_cache:
        return _fresh(build, source, options, arch, name, key)
    if path.is_file():
        return CompileResult(path.read_bytes(), key, "", True)
    with _key_lock(path):
        if path.is_file():      # another process built it while this one waited for the lock
            return CompileResult(path.read_bytes(), key, "", True)
        result = _fresh(build, source, options, arch, name, key)
        _write_atomic(path, result.cubin)
    return result


def _fresh(build, source: str, options: tuple[str, ...], arch: str, name: str, key: str) -> CompileResult:
    cubin, log = build(source, options, arch, name)
    return CompileResult(cubin, key, log, False)


@contextlib.contextmanager
def _key_lock(path: Path):
    """An exclusive lock on `path`.lock while one process compiles that key: the GPU test suite's
    xdist workers and the tuner's local workers ask for the same cubins at once, and without it
    each compiled its own copy (session 8: 12 workers, every job out of time compiling). The lock
    file stays (an empty file per key); the kernel drops the lock if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _compile_nvcc(source: str, options: tuple[str, ...], arch: str, name: str) -> tuple[bytes, str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise BuildError("nvcc not found on PATH", hint="install the CUDA toolkit or use compiler='nvrtc'")
    with tempfile.TemporaryDirectory(prefix="cubridge_nvcc_") as tmp:
        src, out = Path(tmp) / name, Path(tmp) / "out.cubin"
        src.write_text(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", *options, "-o", str(out), str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_NVCC_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"nvcc timed out after {_NVCC_TIMEOUT_S} s", where=name) from e
        log = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0 or not out.is_file():
            raise BuildError(f"nvcc failed (exit {proc.returncode}) for {arch}:\n{log}", where=name,
                             hint="command: " + " ".join(cmd))
        return out.read_bytes(), log


@functools.lru_cache(maxsize=None)
def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()       # loads libnvrtc: a missing library fails here, not mid-build
    except Exception as e:   # noqa: BLE001 - cupy missing, or it cannot find libnvrtc (any error type)
        raise BuildError(f"NVRTC is not available through CuPy: {str(e).splitlines()[0]}",
                         hint="pip install cupy-cuda13x nvidia-cuda-nvrtc, or use compiler='nvcc'") from e
    return nvrtc


def _compile_nvrtc(source: str, options: tuple[str, ...], arch: str, name: str) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise BuildError(f"NVRTC failed ({e}) for {arch}:\n{log}", where=name,
                             hint="options: " + " ".join(options)) from e
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog).strip()
    finally:
        nvrtc.destroyProgram(prog)


def portable_options(options: list[str]) -> list[str]:
    """Compiler options as a run directory records them: the reference kernel's include folder
    (-I, an absolute path of the tuning machine) is left out; cubridge.paths finds it on load."""
    return [o for o in options if not o.startswith("-I")]
