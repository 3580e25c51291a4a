"""Fill the cubin cache for tests/gpu/test_bwd_variants.py's Hopper cases before pytest -n N runs them:
each xdist worker's module fixture builds every specialisation itself, so 8 workers ran the same ~40 nvcc
builds 8 times over on the device's 16 cores; built once here (16 at a time) they are cache hits there.
Lowers under the current environment (CUBRIDGE_BWD_Q_LIST, CUBRIDGE_BWD_RELU_SPLIT as the pytest run
will see them) and builds VARIANT_OPTION (or CUBRIDGE_BWD_VARIANT_OPTION's) at every Hopper shape's (D, dtype), and the other variant
options CUBRIDGE_BWD_OPTIONS names for the option cases' variants and shapes. Prints one line.

    CUBRIDGE_BWD_OPTIONS=... python3 experiments/prebuild_bwd_variants.py
"""
from __future__ import annotations

import importlib.util
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests" / "gpu" / "test_bwd_variants.py"


def _test_module():
    spec = importlib.util.spec_from_file_location("_bwd_variant_cases", TESTS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jobs() -> set[tuple[str, int, bool, str]]:
    """(source, D, bf16, option) of every Hopper specialisation the test module's cases build."""
    from cubridge.runtime import fa3_bwd_sm90 as hb
    from cubridge.runtime.variant_bwd import VariantBackward
    t = _test_module()
    shapes = t._hopper_shapes()
    out = set()
    for name, params in t.VARIANTS:
        source = VariantBackward(name, **params).hopper.source
        out |= {(source, s[5], s[6] == t.BF16, hb.variant_option()) for s in shapes}
    for option in t._other_variant_options():
        for name, params in t.HOPPER_OPTION_VARIANTS:
            source = VariantBackward(name, use_hopper=True, hopper_option=option, **params).hopper.source
            out |= {(source, s[5], s[6] == t.BF16, option) for s in (shapes[0], shapes[4])}
    return out


def main() -> int:
    from cubridge.runtime import fa3_bwd_sm90 as hb
    t0 = time.time()
    todo = sorted(jobs(), key=lambda j: (j[3], j[1], j[2], j[0]))
    failed = []

    def build(job):
        source, d, bf16, option = job
        try:
            # CUBRIDGE_BWD_FUSED_CONVERT=1 (session 16): the DQ_FUSE build the fused cases run; else the staged
            # convert's build where it is the variants' default (STAGED_VARIANT_DEFAULT, CUBRIDGE_BWD_STAGED_CONVERT)
            fuse = hb.fused_convert_enabled() if hb.fuse_capable(hb.OPTIONS[option]) else 0
            staged = not fuse and hb.staged_convert_enabled(hb.STAGED_VARIANT_DEFAULT)
            hb.build_cubin(d, False, bf16, option=option, source=source, fuse=fuse, staged_convert=staged)
        except Exception as e:  # noqa: BLE001 - the test that needs it reports the failure
            failed.append(f"{option} D{d} bf16={bf16}: {type(e).__name__}: {str(e)[:160]}")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, todo))
    print(f"prebuilt {len(todo) - len(failed)}/{len(todo)} variant backward cubins in {time.time() - t0:.0f} s"
          + "".join(f"\n  FAILED {f}" for f in failed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
