"""The "backward" tuning job (cubridge/search/measure_bwd.py) on a GPU: every backward config of a
run's spec passes the gradient check under the verification rule, is timed at each target shape
beside FlexAttention's backward, and the choice lands in the dispatch entries; a config that is
wrong for the spec (another spec's lowering swapped in) fails its check and is never chosen."""
from __future__ import annotations

import textwrap

import pytest
import torch

from cubridge.config import load_config
from cubridge.cuir.parser import parse_file
from cubridge.runtime.kernels import reference_kernel
from cubridge.search import backward
from cubridge.search.measure_bwd import measure_backward
from cubridge.search.messages import Candidate
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer
from cubridge.vocab import Proposal, TrialState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                reason="the backward kernel (fa2_bwd_sm80) needs an sm_80+ GPU")


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
REF, ARCH = ("fa3_sm90", "sm_90a") if HOPPER else ("fa2_sm80", "sm_80")   # the run this GPU would tune


def job_for(tmp_path, spec: str, head_dim: int = 64):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"""\
        spec: {spec}
        reference: {REF}
        arch: {ARCH}
        shapes: {{heads_q: 8, heads_kv: 2, head_dim: {head_dim}, lengths: [1024, 2048]}}
        budget: {{trials: 4, minutes: 2}}
        output: {tmp_path / 'out'}
        backward: true
        """))
    cfg = load_config(path)
    cand = transfer(parse_file(reference_kernel(REF).cuir_path()), load_spec(spec))
    return cfg, backward.job(cfg, Candidate(Proposal(cand.text, "rules"), REF))


@pytest.mark.parametrize("spec", ["prefixlm", "relative_pos"])
def test_every_config_is_checked_timed_and_chosen(tmp_path, spec):
    cfg, job = job_for(tmp_path, spec)
    outcome, data = measure_backward(job.payload)
    assert outcome.state == TrialState.OK, outcome.reason
    labels = backward.space(64, cfg.arch)      # on an sm_90 run: the fa2 configs and the Hopper variant backward
    assert set(data["checks"]) == set(labels) and set(data["checks"].values()) == {"pass"}, data["checks"]
    for t in cfg.shapes.targets:
        row = data["shapes"][t.key]
        assert set(row["configs_ms"]) == set(labels) and all(ms > 0 for ms in row["configs_ms"].values())
        assert row["flops"] > 0 and ("flex" in row["baselines_ms"] or "flex" in row["baseline_errors"])
    dispatch = [{"shape": t.key} for t in cfg.shapes.targets]
    backward.choose({"outcome": outcome.to_json(), **data}, dispatch)
    assert all(e["backward"]["config"] in labels for e in dispatch)


def test_a_wrong_backward_fails_its_check(tmp_path, monkeypatch):
    """The check can fail: causal's backward run for the prefixlm spec misses the prefix's keys
    past the diagonal, so dQ, dK and dV are wrong there."""
    from cubridge.search import measure_bwd
    real = measure_bwd._variant_backward
    monkeypatch.setattr(measure_bwd, "_variant_backward", lambda spec, label, sp: real(load_spec("causal"), label, {}))
    _, job = job_for(tmp_path, "prefixlm")
    outcome, data = measure_backward(job.payload)
    assert outcome.state == TrialState.WRONG_ANSWER and all(v != "pass" for v in data["checks"].values()), data["checks"]
