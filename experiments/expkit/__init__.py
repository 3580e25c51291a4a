"""What the experiment scripts share, in one package: a script imports this (and expkit.peers, the
FA4 comparison's peer systems) and cubridge, nothing else of experiments/ (its own folder is on
sys.path when it runs, so `import expkit` needs no path edit; importing expkit makes the
checkout's cubridge importable where it is not installed).

Timing: time_ms_interleaved (the one timing protocol, round-robin). Variants: Ours (rules
transfer, lowering and launch of a variant on fa3_sm90, as the tuner runs it), Variant (one with
an edited source), replaced (a source edit), the verification rule at the GPU test shapes
(check, check_all), the causal softmax baseline. Provenance: versions(). The op's host time per call and the GPU time a call adds: host_us_per_call, gpu_ms. Kernel patches
(experiments/patches/: the peer A/B's changes, and under knobs/ the experiment knobs that left the
product kernel: kv_ascending, serial_tiles, timeline): patched_source, patched_files,
inline_headers. SASS: disassembler(). Gradients of two systems: grad_sanity, grad_rel_errors. Old kernel versions by commit: source_at("COMMIT:PATH").
"""
from __future__ import annotations

import ctypes
import gc
import glob
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]       # the checkout (experiments/expkit/__init__.py)
try:
    import cubridge  # noqa: F401 - installed (pip install -e .) or on PYTHONPATH
except ModuleNotFoundError:     # a bare checkout: the one place experiments/ edits sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cubridge import rule  # noqa: E402
from cubridge.cuir.parser import parse_file  # noqa: E402
from cubridge.lower import lower  # noqa: E402
from cubridge.lower.fa3_sm90 import wide_tile  # noqa: E402
from cubridge.runtime.fa3_sm90 import build_cubin, default_config, fa3_forward  # noqa: E402
from cubridge.runtime.kernels import reference_kernel  # noqa: E402
from cubridge.runtime.timing import bench_round_robin  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.rules import transfer  # noqa: E402

PATCHES = ROOT / "experiments" / "patches"
KERNEL_REL = Path("ref_kernels") / "fa3_sm90"
TOKENS = 16384          # tokens per shape: B = TOKENS // N
D = 128
WARMUP = 5
REPEATS = 30
# The GPU test shapes (tests/gpu/test_variants.py): ragged N, MHA / GQA / MQA, both head dims.
CHECK_SHAPES = [(1, 4, 4, 1000, 128), (2, 8, 2, 300, 64), (1, 4, 1, 17, 128), (1, 2, 2, 2500, 128)]


def attended_pairs(n: int, causal: bool) -> int:
    return n * (n + 1) // 2 if causal else n * n


def bwd_reference():
    """tests/support/bwd_reference.py (the dense backward's end-aligned autograd reference), loaded
    by path: the scripts use the tests' one reference, with no sys.path edit."""
    import importlib.util
    path = ROOT / "tests" / "support" / "bwd_reference.py"
    spec = importlib.util.spec_from_file_location("cubridge_tests_bwd_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRAD_SANITY_REL = 0.05   # max |ours - peer| / max |peer| per gradient: a go / no-go for a timing row


def bwd_inputs(b: int, hq: int, hkv: int, n: int, d: int, seed: int):
    """(q, k, v, dout) in bf16 for a backward benchmark, drawn q, dout, k, v in that order from one CUDA
    generator seeded `seed` (the backward benchmarks' shared draw, so their rows time the same tensors)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, hq, n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    return q, k, v, dout


def grad_rel_errors(grads, ref) -> dict[str, float]:
    """{dq, dk, dv: max |g - r| / max |r|} of two systems' gradients (NaN stays NaN)."""
    return {name: float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
            for name, g, r in zip(("dq", "dk", "dv"), grads, ref)}


def grad_sanity(grads, ref, rel: float = GRAD_SANITY_REL) -> str:
    """'' if every gradient is within `rel` of the reference system's, else 'WRONG: ...' naming
    what is off (the verification rule itself is in the GPU tests; this only flags a timing row)."""
    bad = [f"{name} rel err {e:.3g}" for name, e in grad_rel_errors(grads, ref).items() if not e <= rel]
    return "WRONG: " + ", ".join(bad) if bad else ""

def time_ms_interleaved(fns) -> list[float]:
    """Median ms of each callable, timed round-robin with L2 flushed before each call
    (cubridge.runtime.timing.bench_round_robin: drift hits every system alike)."""
    return [t.median_ms for t in bench_round_robin(fns, warmup=WARMUP, reps=REPEATS)]


# The op's host and GPU-busy timing (experiments/bench_op.py, bench_document.py).
CALLS = 200
SLEEP_CYCLES = 400_000_000          # ~0.2 s of GPU time at 1.98 GHz: longer than CALLS enqueues
HOLD_CYCLES = 1_000_000             # ~0.5 ms at 1.98 GHz: longer than either call's host path


def host_us_per_call(fn) -> tuple[float, float]:
    """(median, mean) host microseconds per call, the GPU busy throughout."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        times = []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.enable()
    torch.cuda.synchronize()
    return statistics.median(times), statistics.fmean(times)


def gpu_ms(fns, reps: int = 50) -> list[float]:
    """Median GPU milliseconds of each callable between two events, round-robin, L2 flushed, the
    GPU held busy before the start event so no call's host path shows up as GPU idle time."""
    from cubridge.runtime.timing import _flush_buffer
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    flush = _flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        for i, fn in enumerate(fns):
            flush.fill_(r & 0xFF)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [statistics.median(t) for t in times]


def versions() -> dict:
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    import triton
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "driver": smi, "nvcc": nvcc[-1] if nvcc else None, "python": platform.python_version()}


class NoArgs(ctypes.Structure):
    """An empty VariantArgs, for launching the reference kernel itself through the variant path."""
    _fields_ = [("unused", ctypes.c_int32)]


_BOUND: dict[tuple, dict] = {}     # Ours.fn's bound inputs by (spec, shape, tile, device)


class Ours:
    """Variants transferred by the rules proposer and lowered onto fa3_sm90, launched as the
    tuner would. `transform` edits each lowered source before it is built (experiments A/B
    source changes through it)."""

    def __init__(self, transform=None):
        self.ref = parse_file(reference_kernel("fa3_sm90").cuir_path())
        self.transform = transform
        self.cache = {}

    def lowered(self, name):
        """(candidate, lowered kernel, the source that runs) of one variant."""
        if name not in self.cache:
            cand = transfer(self.ref, load_spec(name))
            kern = lower(cand.program, "fa3_sm90")
            self.cache[name] = (cand, kern, self.transform(kern.source) if self.transform else kern.source)
        return self.cache[name]

    def fn(self, name, q, k, v, block_n=None, max_ctas=None, out=None, overrides=None):
        """overrides: Fa3Config fields to replace in the variant default (e.g. stages)."""
        cand, kern, source = self.lowered(name)
        B, Hq, N, Dh = q.shape
        cfg = default_config(Dh, False, q.dtype == torch.bfloat16, N, variant=True, wide=wide_tile(kern.ir))
        if block_n:
            cfg = replace(cfg, block_n=block_n)
        if overrides:
            cfg = replace(cfg, **overrides)
        key = (name, N, k.shape[2], Hq, k.shape[1], B, cfg.block_m, cfg.block_n, str(q.device))
        if key not in _BOUND:
            # A table mask's block classes at 8k take seconds to build; variant_tiles' configs of one
            # variant (one Ours each) share them (read-only inputs, the same for every source edit).
            _BOUND[key] = cand.bind(Nq=N, Nk=k.shape[2], Hq=Hq, Hkv=k.shape[1], B=B,
                                    params={"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, device=q.device)
        inputs = _BOUND[key]
        launch = replace(kern.args(inputs, q.device), source=source)
        out = torch.empty_like(q) if out is None else out
        return lambda: fa3_forward(q, k, v, causal=False, config=cfg, out=out, variant=launch, max_ctas=max_ctas)


def replaced(pairs):
    """A source edit: each (old, new) replaced, an `old` that is not in the source an error."""
    def fn(source: str) -> str:
        for old, new in pairs:
            if old not in source:
                raise SystemExit(f"--replace {old!r}: not in the lowered source")
            source = source.replace(old, new)
        return source
    return fn


def causal_baseline(n: int, hq: int = 32):
    """Llama2-7B-head bf16 inputs at N (16k tokens per shape), an output buffer, our causal softmax
    kernel's default config there, and {"causal softmax": its call}: the baseline every
    normalisation is read against. Returns (b, q, k, v, out, cfg, fns)."""
    b = max(1, TOKENS // n)
    q, k, v = (torch.randn(b, hq, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    cfg = default_config(D, True, True, n)
    return b, q, k, v, out, cfg, {"causal softmax": lambda: fa3_forward(q, k, v, causal=True, config=cfg, out=out)}


class Variant:
    """One lowered variant with an edited source (Ours does the lowering and launch)."""

    def __init__(self, name, source_fn, overrides=None):
        self.name, self.spec, self.ours = name, load_spec(name), Ours(source_fn)
        self.source = self.ours.lowered(name)[2]
        self.overrides = overrides or {}

    def fn(self, q, k, v, out):
        return self.ours.fn(self.name, q, k, v, out=out, overrides=self.overrides)


def check_all(systems: dict, lengths) -> dict:
    """Build every (source, config) up front, in parallel (nvcc runs outside the GIL), then the
    verification rule for each system: {label: "passed" or its failures}, printed as it goes."""
    configs = {default_config(dh, False, True, n, variant=True) for (_, _, _, n, dh) in CHECK_SHAPES}
    configs |= {default_config(D, False, True, n, variant=True) for n in lengths}
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: build_cubin(job[0], source=job[1]),
                      [(c, var.source) for var in systems.values() for c in configs]))
    checks = {}
    for label, var in systems.items():
        checks[label] = check(var) or "passed"
        print(f"check {label:<22} {checks[label]}", flush=True)
    return checks


def check(var: Variant) -> list[str]:
    """The verification rule (cubridge.rule.check_run) at the GPU test shapes, plus scores scaled 4x
    (softcap and sigmoid saturation exercised)."""
    failures = []
    for shape in CHECK_SHAPES:
        for scale in (1.0, 4.0):
            B, Hq, Hkv, N, Dh = shape
            g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{var.name}{shape}{scale}".encode()))
            dtype = torch.float16 if N == 300 else torch.bfloat16
            q = (torch.randn(B, Hq, N, Dh, device="cuda", generator=g) * scale).to(dtype)
            k = (torch.randn(B, Hkv, N, Dh, device="cuda", generator=g) * scale).to(dtype)
            v = torch.randn(B, Hkv, N, Dh, device="cuda", generator=g).to(dtype)
            golden = var.spec.run_reference(q.double(), k.double(), v.double())
            why = rule.check_run(lambda q, k, v, out: var.fn(q, k, v, out)(), (q, k, v), golden,
                                 var.spec.run_reference(q, k, v))
            if why:
                failures.append(f"{shape} x{scale}: {why}")
    return failures


# ------------------------------------------------------------------ kernel patches
def _apply(patch: Path, cwd: str) -> subprocess.CompletedProcess:
    """patch(1), or git apply where the image has no patch binary."""
    try:
        return subprocess.run(["patch", "-p1", "--forward", "-s", "--no-backup-if-mismatch", "-i", str(patch)], cwd=cwd,
                              capture_output=True, text=True)
    except FileNotFoundError:
        return subprocess.run(["git", "apply", "-p1", "--unsafe-paths", str(patch)], cwd=cwd,
                              capture_output=True, text=True)


def patched_files(*names: str, kernel_text: str | None = None) -> dict[str, str]:
    """file name -> patched text, for every file of ref_kernels/fa3_sm90 that the patches changed.
    A name is experiments/patches/NAME.patch (e.g. "k_before_v", "knobs/kv_ascending"); several
    are applied in order. kernel_text: patch this kernel.cu instead (a lowered variant's source:
    hunks outside the generated regions apply to it as to the reference)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / KERNEL_REL, Path(tmp) / KERNEL_REL)
        if kernel_text is not None:
            (Path(tmp) / KERNEL_REL / "kernel.cu").write_text(kernel_text)
        for name in names:
            if not (PATCHES / f"{name}.patch").is_file():
                raise SystemExit(f"error: experiments/patches/{name}.patch: no such patch")
            done = _apply(PATCHES / f"{name}.patch", tmp)
            if done.returncode != 0:
                raise SystemExit(f"error: experiments/patches/{name}.patch: does not apply to "
                                 f"{KERNEL_REL}: {done.stdout.strip()} {done.stderr.strip()} "
                                 "(regenerate it against the current kernel)")
        return {f.name: f.read_text() for f in (Path(tmp) / KERNEL_REL).iterdir()
                if f.is_file() and (not (ROOT / KERNEL_REL / f.name).is_file()
                                    or f.read_text() != (ROOT / KERNEL_REL / f.name).read_text())}


def lowered_patched(source: str, *names: str) -> str:
    """A lowered variant's source with kernel patches applied to it (kernel.cu hunks outside the
    generated regions, and headers, which get inlined): e.g. `Ours(lambda s: lowered_patched(s,
    "mask_classes"))` runs every variant with the patched consumer."""
    changed = patched_files(*names, kernel_text=source)
    return inline_headers(changed.get("kernel.cu", source), changed)


def inline_headers(text: str, changed: dict[str, str]) -> str:
    """`text` with each changed header's #include replaced by its patched body (the build's -I
    finds the product's headers, not the copy's)."""
    for header, body in changed.items():
        if header != "kernel.cu":
            body = "\n".join(ln for ln in body.splitlines() if ln.strip() != "#pragma once")
            text = text.replace(f'#include "{header}"', body)
    return text


def patched_source(*names: str) -> str:
    """kernel.cu with the patches applied and the headers they changed inlined."""
    changed = patched_files(*names)
    return inline_headers(changed.get("kernel.cu", (ROOT / KERNEL_REL / "kernel.cu").read_text()), changed)


def header_only(*names: str) -> dict[str, str] | None:
    """The changed headers of patches that leave kernel.cu alone (they then apply to every
    lowered variant too, which includes the same headers), else None."""
    changed = patched_files(*names)
    return None if "kernel.cu" in changed else changed


# One SASS instruction line of cuobjdump -sass / nvdisasm -c: /*address*/, an optional predicate
# (@P0, @!PT, @UP1), the opcode with its modifiers, the rest (operands, ';', scheduling comment).
SASS_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P[0-9T] )?([A-Z][A-Z0-9_.]*)(.*)$")


def sass_opcodes(sass: str) -> list[str]:
    """The opcode (with modifiers, e.g. HGMMA.64x128x16.F32.BF16) of every instruction, in order."""
    return [m.group(2) for m in map(SASS_INSN.match, sass.splitlines()) if m]


def disassembler() -> list[str]:
    """The command that prints a cubin's SASS: cuobjdump -sass, or nvdisasm (the CUDA toolkit's
    or the nvidia-cuda-nvdisasm wheel's) where cuobjdump is not installed."""
    if shutil.which("cuobjdump"):
        return [shutil.which("cuobjdump"), "-sass"]
    found = shutil.which("nvdisasm") or next(iter(glob.glob(
        str(Path(sys.prefix) / "lib" / "python3*" / "site-packages" / "nvidia" / "*" / "bin" / "nvdisasm"))), None)
    if not found:
        raise SystemExit("error: no cuobjdump or nvdisasm on PATH (CUDA toolkit) and no "
                         "nvidia-cuda-nvdisasm wheel; install one of them")
    return [found, "-c"]


def source_at(spec: str) -> Path:
    """A kernel source as a path: `COMMIT:PATH` (a version kept in git history, written with its
    folder at that commit into a temporary directory, so its includes resolve as they did) or a
    plain path. Measured old versions are named by their commit instead of frozen copies.

    >>> source_at("HEAD:README.md").name
    'README.md'
    """
    commit, sep, rel = spec.partition(":")
    if not sep or Path(spec).exists():
        return Path(spec)
    folder = str(Path(rel).parent) if Path(rel).parent != Path(".") else ""
    dest = Path(tempfile.mkdtemp(prefix=f"source_{commit}_"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *([folder] if folder else [rel])],
                                 check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"error: {spec}: git cannot give it ({e.stderr.decode(errors='replace').strip()}); "
                         "name a commit of this checkout's history (a shallow clone may lack it)") from e
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / rel


def call_with_env(envs: dict, call, *args):
    """call(*args) with the environment variables `envs` set (the runtime reads its switches, e.g.
    CUBRIDGE_BWD_BNHD or CUBRIDGE_BWD_GQA_SPLIT, at each call), each restored to what it was after."""
    import os
    saved = {key: os.environ.get(key) for key in envs}
    os.environ.update(envs)
    try:
        return call(*args)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
