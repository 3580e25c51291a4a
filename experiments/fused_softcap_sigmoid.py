"""Composite's softcap fused into its sigmoid (cubridge/lower/fusion.py: one MUFU op per score
instead of two) against the same kernel with the fusion switched off, beside our causal softmax.

The lowering emits the fused fast path behind a uniform bias test and the two-MUFU form
(tanh, then the sigmoid's tanh) otherwise; the edit below adds a knob that forces the second,
so `+CUIR_UNFUSED=1` configs are the unfused kernel (what the lowering emitted before) and the
rest are the product. Every config is verified under the rule first (variant_tiles.py).

    python experiments/fused_softcap_sigmoid.py --configs 128x128s2 128x128s2+CUIR_UNFUSED=1 \\
        --n 8192 4096 16384 --out $OUT/fused.json
(arguments are variant_tiles.py's; the variant is composite and the edit is added)

The first run of this experiment (`results/fused_softcap_sigmoid_h100.json`) predates the
lowering: it spliced the same polynomial into the unfused source by hand (knob CUIR_FUSED).
"""
import runpy
import sys
from pathlib import Path

OLD = "  if (fabsf(bias) <= "
NEW = """#ifndef CUIR_UNFUSED
#define CUIR_UNFUSED 0
#endif
  if (!CUIR_UNFUSED && fabsf(bias) <= """

if __name__ == "__main__":
    # variant_tiles.py runs with the edit added (run as a script: scripts do not import each other)
    sys.argv = [sys.argv[0], "composite", *sys.argv[1:], "--replace", OLD, NEW]
    runpy.run_path(str(Path(__file__).with_name("variant_tiles.py")), run_name="__main__")
