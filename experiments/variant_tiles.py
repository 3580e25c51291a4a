"""Tile configs and kernel knobs for one lowered variant on fa3_sm90, each beside our causal softmax
kernel (its default config) in one round-robin: every config is first verified on the GPU under
the verification rule (sigmoid_fma_share.check: ragged, GQA, fp16, scores scaled 4x), then all
are timed together (bench_fa3's protocol: L2 flushed, median of 30), Llama2-7B heads, bf16.

    python experiments/variant_tiles.py composite --configs 128x128s2 192x80s2 128x128s2+serial_tiles \\
        --n 8192 4096 --out $OUT/composite_tiles.json

A config is BMxBNsS, optionally followed by +NAME experiment knobs (experiments/patches/knobs/NAME.patch,
else experiments/patches/NAME.patch, e.g. +mask_classes; applied to the lowered source by
expkit.lowered_patched: kernel.cu hunks outside the generated regions, headers inlined), +q=1
(one Q slot) and +g (one tile per CTA instead of the persistent grid: the tuner's labels without
their "p"). --causal-configs times our dense causal softmax kernel at more configs in the same
round-robin (each checked against the default config's output first), so a variant's ratio can
also be read against the best causal config of the run.

Several variants (`variant_tiles.py tests/corpus/ag_causal.py prefixlm --configs ...`) share one
round-robin, each at every plain config and at the STEM:CONFIG ones of its own stem (rows "STEM
CONFIG"), one process and one start-up for all. --flex-flash [STEM ...] adds FlexAttention's FLASH
backend on each variant (or those named) (its block mask per batch / head
where the mask reads them, expkit.flexcall) to the same round-robin; its ratio per row is
"vs_flex_flash" (FLASH ms / ours: > 1 ours faster). Without flash_attn.cute it says so and times
the rest.

--replace OLD NEW (repeatable) edits every config's lowered source the same way (an experiment
guarded by a macro, so configs with and without it run side by side); each OLD must occur in the
source.
"""
from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from expkit import (CHECK_SHAPES, D, PATCHES, Variant, causal_baseline, check, lowered_patched,  # noqa: E402
                    replaced, time_ms_interleaved, versions)
from expkit.flexcall import flash_available, flex_fn  # noqa: E402
from cubridge.runtime.fa3_sm90 import build_cubin, default_config, fa3_forward  # noqa: E402
from cubridge.runtime.timing import tflops  # noqa: E402
from cubridge.spec import load_spec  # noqa: E402
from cubridge.transfer.pairs import count_attended  # noqa: E402

CONFIG = re.compile(r"^(\d+)x(\d+)s(\d+)((?:\+(?:q=\d+|[a-z_][a-z0-9_]*))*)(\+g)?$")


def parse_config(text: str) -> tuple[dict, tuple[str, ...]]:
    """'192x64s2+serial_tiles+q=1' -> (Fa3Config overrides, knob patch names)."""
    m = CONFIG.match(text)
    if not m:
        raise SystemExit(f"config {text!r}: expected BMxBNsS[+KNOB...][+q=1][+g], e.g. 128x128s2+serial_tiles")
    out = {"block_m": int(m.group(1)), "block_n": int(m.group(2)), "stages": int(m.group(3))}
    knobs = [k for k in m.group(4).split("+") if k]
    for k in [k for k in knobs if k.startswith("q=")]:
        out["q_slots"] = int(k[2:])
        knobs.remove(k)
    if m.group(5):
        out["persistent"] = False
    return out, tuple(f"knobs/{k}" if (PATCHES / "knobs" / f"{k}.patch").is_file() else k for k in knobs)


def knob_edit(edit, knobs: tuple[str, ...]):
    """`edit` followed by the knob patches (expkit.lowered_patched: the lowered source is patched
    outside its generated regions, the headers a patch changes are inlined)."""
    if not knobs:
        return edit
    return lambda source: lowered_patched(edit(source), *knobs)


def configs_of(variant: str, configs) -> list[str]:
    """The configs one variant runs: every plain config, and STEM:CONFIG where STEM is its stem
    (`ag_causal:128x176s2` for tests/corpus/ag_causal.py only)."""
    out = []
    for c in configs:
        stem, _, config = c.rpartition(":")
        if not stem or stem == Path(variant).stem:
            out.append(config)
    if not out:
        raise SystemExit(f"{variant}: no config applies (plain BMxBNsS, or {Path(variant).stem}:BMxBNsS)")
    return out


def label_of(variant: str, config: str, several: bool) -> str:
    """A row's system label: the config alone for one variant (the older runs' tables), else
    "stem config" (tests/corpus/padded_causal.py 128x128s2 -> "padded_causal 128x128s2")."""
    return f"{Path(variant).stem} {config}" if several else config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", nargs="+", help="built-in names or spec paths; several share one round-robin")
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--n", type=int, nargs="+", default=[8192, 4096])
    ap.add_argument("--causal-configs", nargs="*", default=[], help="more configs of the dense causal kernel")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="text replacement applied to every config's lowered source")
    ap.add_argument("--flex-flash", nargs="*", default=None, metavar="STEM",
                    help="time FlexAttention's FLASH backend in the same round-robin: on every variant, or "
                         "on those named (spec stems)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    edit = replaced(args.replace) if args.replace else (lambda s: s)
    several = len(args.variant) > 1
    systems, names = {}, {}
    for name in args.variant:
        for c in configs_of(name, args.configs):
            overrides, knobs = parse_config(c)
            label = label_of(name, c, several)
            systems[label], names[label] = Variant(name, knob_edit(edit, knobs), overrides), name
    result = {"gpu": torch.cuda.get_device_name(), "date": str(date.today()), "versions": versions(),
              "variants": args.variant, "replace": args.replace, "protocol": "round-robin, L2 flushed, median of 30 (bench_fa3.time_ms_interleaved)",
              "baseline": "cubridge/fa3_sm90 causal softmax (its default config), same shape, same run",
              "checks": {}, "rows": []}
    build_all(systems, args.n)
    for label, var in systems.items():
        try:
            result["checks"][label] = check(var) or "passed"
        except Exception as e:    # a config that does not build or launch is reported, not fatal
            result["checks"][label] = f"error: {type(e).__name__}: {str(e)[:300]}"
        print(f"check {label:<36} {result['checks'][label]}", flush=True)
    ok = {label: var for label, var in systems.items() if result["checks"][label] == "passed"}
    no_flash = flash_available() if args.flex_flash is not None else "not asked (--flex-flash)"
    flash_on = [n for n in args.variant if not args.flex_flash or Path(n).stem in args.flex_flash]
    result["flex_flash"] = no_flash or "available"
    hq = 32
    for n in args.n:
        b, q, k, v, out, cfg, fns = causal_baseline(n, hq)
        add_causal_configs(fns, args.causal_configs, q, k, v, cfg, out)
        fns.update({label: var.fn(q, k, v, out) for label, var in ok.items()})
        pairs = {name: count_attended(load_spec(name).hooks_for(n, n, hq, hq, "cuda", B=b), b, hq, n, n, device="cuda")
                 for name in ["causal", *args.variant]}
        owner = {label: "causal" if label.startswith("causal softmax") else names[label] for label in fns}
        if not no_flash:
            for name in flash_on:
                label = f"{Path(name).stem} flex_flash" if several else "flex_flash"
                try:
                    hooks = load_spec(name).hooks_for(n, n, hq, hq, "cuda", B=b)
                    fns[label], owner[label] = flex_fn(hooks, q, k, v, "FLASH"), name
                except Exception as e:   # FLASH refuses some mods: say why, time the rest
                    result.setdefault("flex_flash_skipped", {})[f"{name} {n}"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{n:>6} {label}: not timed ({type(e).__name__}: {str(e)[:120]})", flush=True)
        ms = time_ms_interleaved(list(fns.values()))
        base = tflops(4.0 * D * pairs["causal"], ms[0])
        by_label = dict(zip(fns, ms))
        for label, t in by_label.items():
            tf = tflops(4.0 * D * pairs[owner[label]], t)
            row = {"system": label, "variant": owner[label], "N": n, "B": b, "Hq": hq, "D": D, "ms": round(t, 4),
                   "tflops": round(tf, 1), "vs_causal_softmax": round(tf / base, 3)}
            flash = by_label.get(f"{Path(owner[label]).stem} flex_flash" if several else "flex_flash")
            if flash and label in ok:
                row["vs_flex_flash"] = round(flash / t, 3)     # Flex-FLASH ms / ours ms: > 1 is ours faster
            result["rows"].append(row)
            extra = f" {row['vs_flex_flash']:6.3f}x FLASH" if "vs_flex_flash" in row else ""
            print(f"{n:>6} {label:<40} {t:8.3f} ms {tf:7.1f} TFLOPS {tf / base:6.3f}x causal{extra}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


def build_all(systems: dict, lengths) -> None:
    """Every (config, check shape) built up front in parallel (nvcc runs outside the GIL)."""
    jobs = []
    for var in systems.values():
        for n, dh in {(n, dh) for (_, _, _, n, dh) in CHECK_SHAPES} | {(n, D) for n in lengths}:
            cfg = default_config(dh, False, True, n, variant=True)
            jobs.append((replace(cfg, **var.overrides), var.source))
    with ThreadPoolExecutor(max_workers=16) as pool:
        errors = [e for e in pool.map(lambda j: _try_build(*j), jobs) if e]
    for e in errors:
        print("build:", e, flush=True)


def add_causal_configs(fns: dict, configs, q, k, v, cfg, out) -> None:
    """Our dense causal kernel at more configs, each checked against the default config's output."""
    if not configs:
        return
    want = fa3_forward(q, k, v, causal=True, config=cfg)[0]
    for c in configs:
        overrides, knobs = parse_config(c)
        if knobs:
            raise SystemExit(f"--causal-configs {c}: knobs apply to the variant's configs only")
        ccfg = replace(cfg, **overrides)
        got = fa3_forward(q, k, v, causal=True, config=ccfg)[0]
        err = (got.float() - want.float()).abs().max().item()
        if not err < 2e-2:   # both bf16 outputs of the same attention: rounding-level apart
            print(f"causal softmax {c}: max |diff| to the default config {err:.3g}: not timed", flush=True)
            continue
        fns[f"causal softmax {c}"] = (lambda ccfg=ccfg: fa3_forward(q, k, v, causal=True, config=ccfg, out=out))


def _try_build(cfg, source):
    try:
        build_cubin(cfg, source=source)
    except Exception as e:
        return f"{cfg}: {str(e)[-300:]}"
    return None


if __name__ == "__main__":
    main()
