"""Small launches of both backward kernels (ref_kernels/fa2_bwd_sm80 in both dQ modes, a lowered
variant backward, ref_kernels/fa3_bwd_sm90) for compute-sanitizer (racecheck, synccheck, memcheck):
issue 17's "compute-sanitizer clean". Causal cases with Nq < Nk and Nq > Nk (queries end-aligned:
row i at position Nk - Nq + i; the first Nq - Nk rows then see no key), ragged, GQA / MQA.

Each case is also checked under the verification rule (golden: torch.autograd of the end-aligned
reference in float64; ref: the same in the kernel dtype), so a kernel the tool perturbs into a
wrong answer fails here too (exit 1). The forward's out / LSE come from the float64 reference, so
only the backward kernels run under the tool. Shapes are tiny: racecheck slows kernels ~100x.

    compute-sanitizer --tool racecheck --error-exitcode 9 python3 experiments/sanitize_bwd.py
    python3 experiments/sanitize_bwd.py --only fa3_bwd_sm90 [--fa3-option bulk_overlap]
    python3 experiments/sanitize_bwd.py --only hopper_variants [--fa3-option bulk_overlap_lse_arriveall]
"""
from __future__ import annotations

import argparse
import sys

import expkit  # makes the checkout's cubridge importable (experiments/expkit/)
import torch

from cubridge import rule  # noqa: E402

reference = expkit.bwd_reference().reference

BF16, F16 = torch.bfloat16, torch.float16
# (kernel, deterministic, B, Hq, Hkv, Nq, Nk, D, dtype, causal)
DENSE = [
    ("fa2_bwd_sm80", False, 1, 4, 2, 77, 300, 128, BF16, True),
    ("fa2_bwd_sm80", True, 1, 4, 2, 77, 300, 128, BF16, True),
    ("fa2_bwd_sm80", False, 1, 2, 1, 200, 77, 64, F16, True),
    ("fa2_bwd_sm80", True, 1, 2, 1, 200, 77, 64, F16, True),
    ("fa3_bwd_sm90", False, 1, 4, 2, 77, 300, 128, BF16, True),
    ("fa3_bwd_sm90", False, 1, 2, 1, 200, 77, 64, F16, True),
    ("fa3_bwd_sm90", False, 1, 2, 2, 150, 150, 128, F16, False),
    # session 16: full, ragged, GQA, 3 query tiles of 80 per head (TILE_M80's one dQ slot over 6 steps per CTA)
    ("fa3_bwd_sm90", False, 1, 4, 2, 170, 300, 128, BF16, False),
]
# (spec, deterministic, B, Hq, Hkv, Nq, Nk, D): lowered variant backwards with fewer queries than keys
VARIANTS = [("prefixlm", False, 1, 4, 2, 100, 260, 128), ("share_question", True, 1, 2, 1, 90, 300, 64)]
# the same on the Hopper backward (cubridge.lower.fa3_bwd_sm90, sm_90): a block table, the one-pass
# P / dS path (composite's softcap), an elementwise normalisation; atomic only (no deterministic mode)
HOPPER_VARIANTS = [("prefixlm", False, 1, 4, 2, 100, 260, 128), ("share_question", False, 1, 2, 1, 90, 300, 64),
                   ("composite", False, 1, 2, 2, 150, 150, 128), ("sigmoid", False, 1, 2, 1, 70, 200, 64)]


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def _verdicts(label, grads, golden, ref) -> bool:
    ok = True
    for name, x, g, r in zip(("dq", "dk", "dv"), grads, golden, ref):
        v = rule.compare(x, g, r)
        ok &= bool(v.passed) and not bool(x.isnan().any())
        print(f"  {label} {name}: {'pass' if v.passed else 'FAIL'} {v}")
    return ok


def dense_case(kernel, det, b, hq, hkv, nq, nk, d, dtype, causal, fa3_option=None) -> bool:
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, dtype, nq * 7 + nk)
    scale = d ** -0.5
    out, lse, golden = reference(q.double(), k.double(), v.double(), dout.double(), causal, scale)
    ref = reference(q, k, v, dout, causal, scale)[2]
    poisoned = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    if kernel == "fa3_bwd_sm90":
        from cubridge.runtime.fa3_bwd_sm90 import DEFAULT_OPTION, fa3_backward
        fa3_backward(dout, q, k, v, out.to(dtype), lse.float(), causal=causal, softmax_scale=scale,
                     dq=poisoned[0], dk=poisoned[1], dv=poisoned[2], option=fa3_option or DEFAULT_OPTION)
        kernel = f"{kernel}[{fa3_option or DEFAULT_OPTION}]"
    else:
        from cubridge.runtime.fa2_bwd_sm80 import Fa2BwdSm80
        Fa2BwdSm80()(dout, q, k, v, out.to(dtype), lse.float(), causal=causal, sm_scale=scale, deterministic=det,
                     dq=poisoned[0], dk=poisoned[1], dv=poisoned[2])
    torch.cuda.synchronize()
    label = f"{kernel} {'det' if det else 'atomic'} q{nq} k{nk} h{hq}x{hkv} D{d} {str(dtype)[6:]} " \
            f"{'causal' if causal else 'full'}"
    return _verdicts(label, poisoned, golden, ref)


def variant_case(spec, det, b, hq, hkv, nq, nk, d, hopper: bool = False, fa3_option=None) -> bool:
    from cubridge.runtime.variant_bwd import VariantBackward, reference_forward
    bwd = VariantBackward(spec, use_hopper=hopper, hopper_option=fa3_option if hopper else None)
    q, k, v, dout = _inputs(b, hq, hkv, nq, nk, d, BF16, nq * 11 + nk)
    out, lse = reference_forward(bwd.spec, q.double(), k.double(), v.double())

    def grads(dtype):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        bwd.spec.run_reference(*leaves).backward(dout.to(dtype))
        return [t.grad for t in leaves]
    poisoned = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    bwd(dout, q, k, v, out.to(BF16), lse.float(), sm_scale=d ** -0.5, deterministic=det,
        dq=poisoned[0], dk=poisoned[1], dv=poisoned[2])
    torch.cuda.synchronize()
    kernel = f"fa3_bwd_sm90[{bwd.hopper_option}]" if hopper else "fa2_bwd_sm80"
    return _verdicts(f"variant {spec} {kernel} {'det' if det else 'atomic'} "
                     f"q{nq} k{nk} D{d}", poisoned,
                     grads(torch.float64), grads(BF16))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["fa2_bwd_sm80", "fa3_bwd_sm90", "variants", "hopper_variants"])
    ap.add_argument("--fa3-option", help="fa3_bwd_sm90's performance option (its OPTIONS; default: DEFAULT_OPTION; "
                    "with hopper_variants one of its VARIANT_OPTIONS, default VARIANT_OPTION)")
    args = ap.parse_args(argv)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    ok = True
    for case in DENSE:
        if args.only in (None, case[0]) and (case[0] != "fa3_bwd_sm90" or sm90):
            ok &= dense_case(*case, fa3_option=args.fa3_option)
    if args.only in (None, "variants"):
        for case in VARIANTS:
            ok &= variant_case(*case)
    if args.only in (None, "hopper_variants") and sm90:
        for case in HOPPER_VARIANTS:
            ok &= variant_case(*case, hopper=True, fa3_option=args.fa3_option)
    print("sanitize_bwd:", "all cases pass the rule" if ok else "SOME CASE FAILED THE RULE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
