"""fa2_sm80 at D = 128: the default tiling (128 x 64, 4 warps; 255 registers and 12-84 bytes of
spill stores for every variant, experiments/fa2_spills.py) beside the spill-free options, on the GPU
you have (issue 19 item 7; no A100 is lent, so an H100 runs the sm_80 kernel's sm_90 build):

- 128x64s2w4+split2: the same tiles, S / P / the softmax of each KV tile in two 32-column blocks
  (kernel.cu's KV_SPLIT=2, not unrolled): spill-free for the dense full kernel and 7 of 10 variants
- 128x128s2w8, 64x64s2w4, 128x64s2w8: 16 query rows per warp, spill-free for all (178-254
  registers) at twice the shared-memory bytes per MMA

Each (kernel, option) is first checked on the GPU (the verification rule, float64 golden, at a
ragged GQA shape; output poisoned, inputs unchanged, bitwise rerun), then each kernel's options are
timed round-robin at N = 8k (Llama2-7B heads, B = 2, bf16, L2 flushed, median).

    python experiments/ab_fa2_spills.py --out $OUT/fa2_spills_ab.json [--n 8192] [--options ...]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from expkit import versions  # noqa: E402

from cubridge import rule  # noqa: E402
from cubridge.cuir.parser import parse_file  # noqa: E402
from cubridge.lower import lower  # noqa: E402
from cubridge.paths import ref_kernel_dir  # noqa: E402
from cubridge.runtime.fa2_sm80 import Config, Fa2Sm80, kernel_source  # noqa: E402
from cubridge.runtime.launch import device_arch  # noqa: E402
from cubridge.runtime.timing import attention_flops, bench_round_robin, tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402
from cubridge.transfer.rules import transfer  # noqa: E402

D = 128
OPTIONS = ["128x64s2w4", "128x64s2w4+split2", "128x128s2w8", "64x64s2w4"]
KERNELS = ["dense causal", "dense full", "causal", "prefixlm", "global_sliding_window", "share_question",
           "relative_pos", "composite"]
CHECK = (1, 4, 2, 1000)      # B, Hq, Hkv, N: ragged tail, GQA


def option(text: str) -> tuple[Config, str]:
    """'128x64s2w4+split2+qkroll' -> (config, the source prefix that sets its knobs): +splitN sets
    KV_SPLIT, +qkrollN QK_ROLLED=N (S = Q K^T's k-steps unrolled N-fold, +qkroll: not unrolled; session 13).

    >>> option("128x64s2w4+split2+qkroll")[1]
    '#define KV_SPLIT 2\\n#define QK_ROLLED 1\\n'
    """
    cfg, *knobs = text.split("+")
    prefix = ""
    for knob in knobs:
        if knob.startswith("split") and knob[5:].isdigit():
            prefix += f"#define KV_SPLIT {int(knob[5:])}\n"
        elif knob.startswith("qkroll") and (knob[6:].isdigit() or not knob[6:]):
            prefix += f"#define QK_ROLLED {int(knob[6:] or 1)}\n"
        else:
            raise SystemExit(f"--options {text!r}: unknown knob {knob!r} (knobs: +splitN, +qkroll[N])")
    return Config.parse(cfg), prefix


class System:
    """One kernel (dense reference or a lowered variant) at one option, callable on (q, k, v)."""

    def __init__(self, kernel: str, opt: str, prog):
        self.kernel, self.opt = kernel, opt
        self.cfg, prefix = option(opt)
        self.causal = kernel == "dense causal"
        if kernel.startswith("dense"):
            self.spec, self.cand = load_spec("causal" if self.causal else "full"), None
            self.source = prefix + kernel_source()
        else:
            self.spec = load_spec(kernel)
            self.cand = transfer(prog, self.spec)
            self.source = prefix + lower(self.cand.program, "fa2_sm80").source
        path = Path(tempfile.mkdtemp(prefix="ab_fa2_")) / "kernel.cu"
        path.write_text(self.source)
        self.fa2 = Fa2Sm80(self.cfg, compiler="nvcc", source_path=path)

    def build(self, dtype) -> None:
        self.fa2.build(D, dtype, self.causal, device_arch(torch.device("cuda")))

    def fn(self, q, k, v, out):
        launch = None
        if self.cand is not None:
            inputs = self.cand.bind(Nq=q.shape[2], Nk=k.shape[2], Hq=q.shape[1], Hkv=k.shape[1], B=q.shape[0],
                                    params={"BLOCK_M": self.cfg.block_m, "BLOCK_N": self.cfg.block_n},
                                    device=q.device)
            launch = replace(lower(self.cand.program, "fa2_sm80").args(inputs, q.device), source=self.source)
        return lambda: self.fa2(q, k, v, causal=self.causal, out=out, variant=launch)


def check(system: System) -> str:
    B, Hq, Hkv, N = CHECK
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(system.kernel.encode()))
    q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    before = [t.clone() for t in (q, k, v)]
    out = torch.full_like(q, float("nan"))
    run = system.fn(q, k, v, out)
    run()
    torch.cuda.synchronize()
    if torch.isnan(out).any():
        return "FAIL: output elements never written"
    verdict = rule.compare(out, system.spec.run_reference(q.double(), k.double(), v.double()),
                           system.spec.run_reference(q, k, v))
    first = out.clone()
    run()
    torch.cuda.synchronize()
    if not verdict.passed:
        return f"FAIL: {verdict}"
    if not all(torch.equal(a, b) for a, b in zip(before, (q, k, v))):
        return "FAIL: inputs changed"
    return "pass" if torch.equal(first, out) else "FAIL: second run differs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--options", nargs="+", default=OPTIONS)
    ap.add_argument("--kernels", nargs="+", default=KERNELS)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    prog = parse_file(ref_kernel_dir("fa2_sm80") / "kernel.cuir")
    systems = {(kn, o): System(kn, o, prog) for kn in args.kernels for o in args.options}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: s.build(torch.bfloat16), systems.values()))
    result = {"gpu": torch.cuda.get_device_name(), "versions": versions(), "D": D, "n": args.n,
              "heads": [32, 32], "rows": []}
    b, h, n = max(1, 16384 // args.n), 32, args.n
    q, k, v = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(f"{'kernel':<24} " + " ".join(f"{o:>20}" for o in args.options) + "   (TFLOPS; check)")
    for kn in args.kernels:
        checks = {o: check(systems[kn, o]) for o in args.options}
        ok = [o for o in args.options if checks[o] == "pass"]
        spec = systems[kn, args.options[0]].spec
        pairs = (attention_flops(b, h, D, n, n, kn == "dense causal") / (4 * D) if kn.startswith("dense")
                 else count_attended(spec.hooks_for(n, n, h, h, "cuda"), b, h, n, n, device="cuda"))
        outs = {o: torch.empty_like(q) for o in ok}
        times = dict(zip(ok, bench_round_robin([systems[kn, o].fn(q, k, v, outs[o]) for o in ok], reps=args.reps)))
        row = {"kernel": kn, "checks": checks,
               "ms": {o: round(t.median_ms, 4) for o, t in times.items()},
               "tflops": {o: round(tflops(4.0 * D * pairs, t.median_ms), 1) for o, t in times.items()}}
        result["rows"].append(row)
        print(f"{kn:<24} " + " ".join(f"{row['tflops'].get(o, checks[o][:20]):>20}" for o in args.options), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    base = args.options[0]
    for o in args.options[1:]:
        ratios = [r["ms"][base] / r["ms"][o] for r in result["rows"] if base in r["ms"] and o in r["ms"]]
        if ratios:
            print(f"{o} vs {base}: speed x{min(ratios):.3f} .. x{max(ratios):.3f} over {len(ratios)} kernels")


if __name__ == "__main__":
    main()
