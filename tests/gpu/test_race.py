"""The tuner's final race on the GPU (cubridge.search.measure.race through the `race` job kind):
every finalist of a raced shape gets a round-robin time, a shape with one finalist is not raced,
and a finalist that cannot build drops out with its error while the others are still timed."""
from __future__ import annotations

from cubridge.config import load_config
from cubridge.cuir.parser import parse_file
from cubridge.cuir.printer import to_text
from cubridge.paths import ref_kernel_dir
from cubridge.vocab import Job, Proposal, TrialState
from cubridge.search.jobs import run_job
from cubridge.search.space import SPACES
from cubridge.search.messages import Candidate, payload
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer


def test_race_times_each_finalist_round_robin(tmp_path):
    path = tmp_path / "race.yaml"
    path.write_text(f"spec: prefixlm\nreference: fa3_sm90\narch: sm_90a\n"
                    f"shapes: {{heads_q: 8, heads_kv: 2, head_dim: 128, lengths: [1024, 2048], tokens: 4096}}\n"
                    f"output: {tmp_path / 'out'}\n")
    cfg = load_config(path)
    ref = parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir")
    rules = transfer(ref, load_spec("prefixlm"))
    cand = Candidate(Proposal(to_text(rules.program), "rules", binding=rules.binding.to_json()), "fa3_sm90")
    points = SPACES["fa3_sm90"].best_known(128)
    assert len(points) >= 3
    finalists = {str(i): payload(cfg, cand, pt) for i, pt in enumerate(points[:3])}
    finalists["9"] = {**finalists["0"], "text": "this is not CuIR"}    # cannot build: drops out
    k1, k2 = (t.key for t in cfg.shapes.targets)
    body = {**payload(cfg, cand), "candidate": "race", "finalists": finalists,
               "by_shape": {k1: [0, 1, 2, 9], k2: [2]}}
    res = run_job(Job("race", body, 600, needs_gpu=True))
    assert res.outcome.state == TrialState.OK, res.outcome.reason
    times = res.data["shapes"]
    assert set(times) == {k1}                                # k2 had one finalist: nothing to race
    assert set(times[k1]) == {"0", "1", "2"} and all(0 < ms < 100 for ms in times[k1].values()), times
    assert set(res.data["errors"][k1]) == {"9"}
