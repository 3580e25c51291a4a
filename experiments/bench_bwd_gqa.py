"""The GQA penalty of our Hopper backward beside FA4's and Flex-FLASH's (issue 17, session 14).

Shape of the transformers Llama client's training step: 8k tokens, B 2, D 128, bf16, heads MHA 16 / 16,
GQA 16 / 4 and 32 / 8. Cases: dense causal and full (ours = fa3_bwd_sm90's fa3_backward after our
forward; FA4 = flash_attn.cute's backward through torch.autograd.grad, native GQA) and the prefixlm
variant (ours = VariantBackward on the Hopper kernel; Flex-FLASH = compiled flex_attention with
kernel_options BACKEND FLASH, enable_gqa, its BlockMask). Ours runs at each GQA split of
fa3_bwd_gqa (1 = today's kernel; 2, 4 = CUBRIDGE_BWD_GQA_SPLIT) that the group allows, all in
the same round-robin (cubridge.runtime.timing.bench_round_robin: L2 flushed, GPU work only).

Checks before a time counts: every system's gradients against ours at split 1 (max |x - ours| /
max |ours| per gradient, `agrees` at <= 0.05; the rule itself is tests/gpu/test_bwd_gqa.py), a split's
dK / dV bitwise equal over two calls (`repeatable`). TFLOPS = 2.5 x 4 x D x attended pairs x B x Hq
(issue 17's count; prefixlm's pairs counted from the spec's mask). `vs_mha` = this shape's
TFLOPS / the MHA shape's (the GQA penalty); `x_ours1` = ours at split 1's ms / the system's ms.
The caller's layout (issue 15, --peers layout): "ours[copy]" = the five .contiguous() copies of the model's
[B, N, H, D] memory that cubridge/op's run_backward made, then our backward; "ours[bnhd]" = the same
memory read and written in place (kernel.cu BNHD, CUBRIDGE_BWD_BNHD=1); their ratio is the copies' cost.

    python3 experiments/bench_bwd_gqa.py --out $OUT/bwd_gqa.json [--cases causal full prefixlm] [--reps 10]
    python3 experiments/bench_bwd_gqa.py --table $OUT/bwd_gqa.json
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import expkit
from expkit import grad_rel_errors
from expkit.peers import Unsupported, fa4_backward
import torch

from cubridge.runtime import fa3_bwd_gqa as gqa
from cubridge.runtime import fa3_bwd_layout as lay
from cubridge.runtime import fa3_bwd_sm90 as hb
from cubridge.runtime.timing import attention_flops, bench_round_robin, compiled_flex_attention, tflops
from cubridge.spec import load_spec
from cubridge.transfer.pairs import count_attended

N, B, D = 8192, 2, 128
HEADS = [(16, 16), (16, 4), (32, 8)]
CASES = ["causal", "full", "prefixlm"]
SPLITS = (1, 2, 4)
BWD_FLOP_FACTOR = 2.5
AGREE_REL = 0.05


def _inputs(hq: int, hkv: int):
    return expkit.bwd_inputs(B, hq, hkv, N, D, seed=hq * 131 + hkv)


def splits_for(hq: int, hkv: int) -> list[int]:
    return sorted({gqa.effective(s, hq // hkv) for s in SPLITS})


# "lpt": TILE_ORDER 2 (longest KV tiles first inside sections of (batch, kv head) pairs). Its launcher sizes
# sections to L2 by the pairs' Q / dO bytes, which grow with the group: at 8k, GQA 16 / 4 one pair is ~50 MB,
# so the section is one pair and the order is TILE_ORDER 0's (the CTA model, experiments/bwd_cta_model.py,
# reads that order's causal makespan at 0.81 of ideal vs 1.00 longest-first). "lpt,s1" passes an L2 budget
# that holds every pair (one section: longest-first over the whole grid); lpt,s2 / s4 keep the launcher's sizing.
# Session 15: the dense default's body in that order (_dqw_early_l2lpt); session 14 timed the older pf32_epi body
# (--lpt-option bulk_overlap_lse_lean_issue_pf32_epi_l2lpt reproduces its rows).
DENSE_LPT = "bulk_overlap_lse_lean_issue_pf32_epi_dqw_early_l2lpt"
ALL_PAIRS_L2 = 1 << 40


def ours_dense(causal: bool, q, k, v, dout, split: int, option: str = hb.DEFAULT_OPTION, l2=None):
    from cubridge.runtime.autograd import forward_with_lse
    out, lse = forward_with_lse(q, k, v, causal)
    return lambda: hb.fa3_backward(dout, q, k, v, out, lse, causal=causal, gqa_split=split, option=option,
                                   l2_bytes=l2)


def bnhd(t: torch.Tensor) -> torch.Tensor:
    """The same values as [B, N, H, D] memory seen as [B, H, N, D] (a transformers model's views)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def with_env(name: str, value: str, fn):
    """fn with os.environ[name] = value around each call (the split / layout knobs of the variant path)."""
    return lambda: expkit.call_with_env({name: value}, fn)


def layout_systems(case: str, q, k, v, dout, variant) -> dict:
    """Our backward on the model's [B, N, H, D] memory (split 1): "ours[copy]" as cubridge/op's
    run_backward did it (five .contiguous() copies, then the bhnd kernel), "ours[bnhd]" in place
    (kernel.cu BNHD, CUBRIDGE_BWD_BNHD=1). Both return [B, H, N, D] views of the same values."""
    from cubridge.runtime.autograd import forward_with_lse
    if variant is None:
        out, lse = forward_with_lse(q, k, v, case == "causal")
        bwd = lambda *t: hb.fa3_backward(*t, lse, causal=case == "causal", gqa_split=1)  # noqa: E731
    else:
        out, lse = variant.fwd.fn(variant.name, q, k, v)()
        bwd = lambda *t: with_env(gqa.SPLIT_ENV, "1", lambda: variant.bwd(*t, lse))()  # noqa: E731
    model = [bnhd(t) for t in (dout, q, k, v, out)]
    return {"ours[copy]": lambda: bwd(*(t.contiguous() for t in model)),
            "ours[bnhd]": with_env(lay.ENV, "1", lambda: bwd(*model))}


class VariantOurs:
    """prefixlm lowered onto fa3_sm90 (forward) and fa3_bwd_sm90 (VariantBackward, Hopper); the
    split reaches the variant path through CUBRIDGE_BWD_GQA_SPLIT (set around each call)."""

    def __init__(self, name: str):
        from cubridge.runtime.variant_bwd import VariantBackward
        self.name, self.fwd, self.bwd = name, expkit.Ours(), VariantBackward(name, use_hopper=True)

    def system(self, q, k, v, dout, split: int, l2=None):
        """VariantBackward as the op calls it; with l2, fa3_backward directly with that L2 budget."""
        out, lse = self.fwd.fn(self.name, q, k, v)()
        if l2 is None:
            return with_env(gqa.SPLIT_ENV, str(split), lambda: self.bwd(dout, q, k, v, out, lse))
        b, hq, n, d = q.shape
        va = self.bwd.launchable(b, hq, k.shape[1], n, k.shape[2], d, q.device, hopper=True)
        return lambda: hb.fa3_backward(dout, q, k, v, out, lse, causal=False, option=self.bwd.hopper_option,
                                       variant=va, l2_bytes=l2, gqa_split=split)


def flex_flash(mask_mod, q, k, v, dout):
    fx, cbm = compiled_flex_attention()
    bm = cbm(mask_mod, None, None, N, N, device=q.device) if mask_mod is not None else None
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        out = fx(*leaves, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1], kernel_options={"BACKEND": "FLASH"})
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    except Exception as e:  # noqa: BLE001 - the backend's refusal is the recorded reason
        raise Unsupported(f"{type(e).__name__}: {str(e).strip()[:300]}")
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def flops_of(case: str, hq: int, hkv: int) -> float:
    if case in ("causal", "full"):
        return attention_flops(B, hq, D, N, N, case == "causal")
    hooks = load_spec(case).hooks_for(N, N, hq, hkv, "cuda")
    return 4.0 * D * count_attended(hooks, B, hq, N, N, device="cuda")


def make_systems(case: str, hq: int, hkv: int, q, k, v, dout, variant: VariantOurs | None,
                 wanted: list[str], lpt_options: tuple[str, ...] = (DENSE_LPT,)) -> tuple[dict, dict]:
    """({name: callable}, {name: refusal}) for one (case, heads); wanted: the peers to add."""
    systems, refused = {}, {}
    for s in splits_for(hq, hkv):
        systems[f"ours[s{s}]"] = (variant.system(q, k, v, dout, s) if variant is not None
                                  else ours_dense(case == "causal", q, k, v, dout, s))
    if "lpt" in wanted:   # the variant's option is TILE_ORDER 2 already: only its all-pairs section is new
        systems["ours[lpt,s1]"] = (variant.system(q, k, v, dout, 1, ALL_PAIRS_L2) if variant is not None
                                   else ours_dense(case == "causal", q, k, v, dout, 1, lpt_options[0], ALL_PAIRS_L2))
        for s in splits_for(hq, hkv)[1:] if variant is None else []:
            for i, option in enumerate(lpt_options):   # the second option's rows are "lpt2", and so on
                systems[f"ours[lpt{i + 1 if i else ''},s{s}]"] = ours_dense(case == "causal", q, k, v, dout, s, option)
    if "layout" in wanted:
        systems.update(layout_systems(case, q, k, v, dout, variant))
    peers = {"fa4": lambda: fa4_backward(case == "causal", q, k, v, dout)} if variant is None else {}
    if variant is not None or "flex_dense" in wanted:   # dense: FA4 is the peer unless asked
        mask = {"causal": causal_mask, "full": None}.get(case)
        if variant is not None:
            mask = load_spec(case).hooks_for(N, N, hq, hkv, "cuda").mask_mod
        peers["flex_flash"] = lambda: flex_flash(mask, q, k, v, dout)
    for name, make in ((n, m) for n, m in peers.items() if n in wanted):
        try:
            systems[name] = make()
        except Exception as e:  # noqa: BLE001 - a peer's refusal (any kind) is recorded; ours still run
            refused[name] = str(e)[:300]
            print(f"  {case} {hq}/{hkv} {name}: refused: {str(e)[:160]}", flush=True)
    return systems, refused


def bench_one(case: str, hq: int, hkv: int, reps: int, variant, peers: list[str],
              lpt_options: tuple[str, ...] = (DENSE_LPT,)) -> list[dict]:
    q, k, v, dout = _inputs(hq, hkv)
    systems, refused = make_systems(case, hq, hkv, q, k, v, dout, variant, peers, lpt_options)
    base = dict(case=case, N=N, B=B, Hq=hq, Hkv=hkv, D=D, dtype="bf16")
    grads = {}
    for s, fn in list(systems.items()):
        try:
            grads[s] = [g.clone() for g in fn()]
        except Exception as e:  # noqa: BLE001 - a system failing on its first backward is recorded; the baseline raises
            if s == "ours[s1]":
                raise
            refused[s] = f"{type(e).__name__}: {str(e)[:300]}"
            del systems[s]
            print(f"  {case} {hq}/{hkv} {s}: refused at its first backward: {str(e)[:160]}", flush=True)
    rows = [dict(base, system=s, refused=r) for s, r in refused.items()]
    mine = grads["ours[s1]"]
    names = list(systems)
    times = dict(zip(names, bench_round_robin([systems[s] for s in names], warmup=2, reps=reps)))
    flops = flops_of(case, hq, hkv)
    for s in names:
        ms = times[s].median_ms
        row = dict(base, system=s, bwd_ms=round(ms, 4), bwd_tflops=round(tflops(BWD_FLOP_FACTOR * flops, ms), 1),
                   x_ours1=round(times["ours[s1]"].median_ms / ms, 3))
        if s != "ours[s1]":
            rel = max(grad_rel_errors(grads[s], mine).values())
            row.update(max_rel_vs_ours=float(f"{rel:.3g}"), agrees=rel <= AGREE_REL)
        if s.startswith("ours[") and s not in ("ours[s1]", "ours[copy]", "ours[bnhd]", "ours[lpt,s1]"):
            again = systems[s]()
            row["repeatable"] = bool(torch.equal(again[1], grads[s][1]) and torch.equal(again[2], grads[s][2]))
        rows.append(row)
        print(f"  {case:8s} {hq:2d}/{hkv:2d} {s:10s} {ms:8.3f} ms {row['bwd_tflops']:6.1f} TFLOPS "
              f"x_ours1 {row['x_ours1']:.3f}" + (f" rel {row['max_rel_vs_ours']:.1e}" if "max_rel_vs_ours" in row else "")
              + ("" if row.get("repeatable", True) else " NOT REPEATABLE"), flush=True)
    return rows


def add_penalty(rows: list[dict]) -> None:
    """vs_mha: a GQA row's TFLOPS / the MHA (Hq = Hkv) row's of the same case and system (ours at
    any split against ours at MHA, where there is no split)."""
    family = lambda s: "ours" if s.startswith("ours[s") else "ours[lpt]" if s.startswith("ours[lpt") else s  # noqa: E731
    mha = {(r["case"], family(r["system"])): r["bwd_tflops"] for r in rows
           if r["Hq"] == r["Hkv"] and "bwd_tflops" in r}
    for r in rows:
        ref = mha.get((r["case"], family(r["system"])))
        if "bwd_tflops" in r and r["Hq"] != r["Hkv"] and ref:
            r["vs_mha"] = round(r["bwd_tflops"] / ref, 3)


def prebuild(cases: list[str], lpt_options: tuple[str, ...] = (DENSE_LPT,)) -> None:
    """Every cubin of the run, in parallel (nvcc runs outside the GIL)."""
    jobs = [(c == "causal", s, False) for c in cases if c in ("causal", "full") for s in SPLITS]
    jobs += [(c == "causal", 1, True) for c in cases if c in ("causal", "full")]
    lpt = [(c == "causal", s) for c in cases if c in ("causal", "full") for s in SPLITS]
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(hb.build_cubin, D, causal, True, gqa_split=s, bnhd=b) for causal, s, b in jobs]
        futs += [pool.submit(hb.build_cubin, D, causal, True, option=o, gqa_split=s) for causal, s in lpt
                 for o in lpt_options]
        for f in futs:
            f.result()


def print_table(rows: list[dict]) -> None:
    print("| case | Hq/Hkv | system | bwd ms | TFLOPS | x ours s1 | vs MHA | rel vs ours | repeatable |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "refused" in r:
            print(f"| {r['case']} | {r['Hq']}/{r['Hkv']} | {r['system']} | refused: {r['refused'][:70]} | | | | | |")
            continue
        rel = "" if "max_rel_vs_ours" not in r else f"{r['max_rel_vs_ours']:.1e}" + ("" if r["agrees"] else " DISAGREES")
        print(f"| {r['case']} | {r['Hq']}/{r['Hkv']} | {r['system']} | {r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | "
              f"{r['x_ours1']:.3f} | {r.get('vs_mha', '')} | {rel} | {r.get('repeatable', '')} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--heads", nargs="+", default=[f"{a}/{b}" for a, b in HEADS], help="Hq/Hkv pairs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peers", nargs="*", default=["fa4", "flex_flash", "layout", "lpt"],
                    choices=["fa4", "flex_flash", "flex_dense", "layout", "lpt"],
                    help="systems beside ours at each split (fa4: the dense cases; flex_flash: the variant, and the "
                         "dense cases too with flex_dense; layout: ours[copy] / ours[bnhd] on [B, N, H, D] memory; lpt: "
                         "ours[lpt,sS] in TILE_ORDER 2's longest-first order)")
    ap.add_argument("--lpt-option", nargs="+", default=[DENSE_LPT], choices=sorted(hb.OPTIONS), metavar="OPTION",
                    help="the TILE_ORDER 2 option(s) of the dense lpt rows (a second one's rows: lpt2, ...)")
    ap.add_argument("--table", type=Path, help="print the table of a results JSON and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(json.loads(args.table.read_text())["rows"])
        return 0
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    result = {"gpu": torch.cuda.get_device_name(), "versions": expkit.versions(), "rows": [], "failed": [],
              "lpt_options": args.lpt_option,
              "protocol": f"round-robin, L2 flushed, 2 warm-ups, {args.reps} reps, median (bench_round_robin)"}
    try:
        prebuild(args.cases, tuple(args.lpt_option))
    except Exception:  # noqa: BLE001 - a build failure shows again per case below
        print(f"# prebuild failed\n{traceback.format_exc()[-1500:]}", flush=True)
    variants = {c: VariantOurs(c) for c in args.cases if c not in ("causal", "full")}
    for case in args.cases:
        for hq, hkv in heads:
            try:
                result["rows"] += bench_one(case, hq, hkv, args.reps, variants.get(case), args.peers,
                                            tuple(args.lpt_option))
            except Exception:  # noqa: BLE001 - one case failing is reported, the others still run
                result["failed"].append(dict(case=case, Hq=hq, Hkv=hkv, error=traceback.format_exc()[-1500:]))
                print(f"# {case} {hq}/{hkv}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
            torch.cuda.empty_cache()
            add_penalty(result["rows"])
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
