"""A tuned run directory made on CPU, for the tests of what reads one (the op, its autograd, the
transformers integration, the Llama client, --resume): a config, a synthetic replay recording of
fa3_sm90 at the config's shapes (made-up times, cubridge.search.testing_jobs) and tune() with the
replay runner; then cubridge.load(run) made to run on CPU tensors with a stand-in launch.

    run = replayed_run(tmp, "causal", "{heads_q: 4, heads_kv: 2, head_dim: 128, lengths: [1024]}")
    attn = cpu_op(run.output, lambda q, k, v, out, lse, scale: out.copy_(q))

Imported as `support.tuned_run` (tests/ is on sys.path through tests/conftest.py's folder).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ReplayedRun:
    config: Path        # the YAML config
    recording: Path     # the replay file (for --resume --runner replay --replay FILE)
    output: Path        # the run directory cubridge.load reads


def replayed_run(tmp: Path, spec: str, shapes: str, trials: int = 4, minutes: int = 2) -> ReplayedRun:
    """Tune `spec` on fa3_sm90 (sm_90a) at `shapes` (the config's shapes mapping, YAML flow text)
    with the replay runner into tmp/run; `trials` points of the search space, none on a GPU."""
    from cubridge.config import load_config
    from cubridge.search.runners import make_runner
    from cubridge.search.testing_jobs import synthetic_recording
    from cubridge.search.tuner import tune
    path, rec = tmp / "c.yaml", tmp / "r.json"
    path.write_text(f"spec: {spec}\nreference: fa3_sm90\nshapes: {shapes}\n"
                    f"budget: {{trials: {trials}, minutes: {minutes}}}\noutput: {tmp / 'run'}\n")
    cfg = load_config(path)
    rec.write_text(json.dumps(synthetic_recording("fa3_sm90", cfg.shapes.head_dim, "sm_90a", cfg.shapes.targets)))
    tune(cfg, runner=make_runner("replay", replay=rec), say=lambda *_: None)
    return ReplayedRun(path, rec, cfg.output)


def cpu_op(output: Path, launch, backward=None, counts: dict | None = None):
    """cubridge.load(output) on CPU tensors: each shape's prepared kernel is `launch(q, k, v, out,
    lse, scale)` and, given, `backward(dout, q, k, v, out, lse, scale, rt)` replaces the backward
    kernel; counts["prepare"] counts the per-shape preparations (a cached shape prepares nothing)."""
    import cubridge
    from cubridge.op.kernels import Prepared
    attn = cubridge.load(output)
    attn.device_type = "cpu"

    def prepare(q, k, scale, rt):
        if counts is not None:
            counts["prepare"] = counts.get("prepare", 0) + 1
        prep = Prepared(lambda q, k, v, out, lse: launch(q, k, v, out, lse, scale), torch.empty(q.shape[:3]))
        attn._prepared[(q.shape, k.shape, q.device, scale)] = prep
        return prep
    attn._prepare = prepare
    if backward is not None:
        attn.backward_impl = backward
    return attn
