"""End to end on CPU: `cubridge-tune --dry-run` with `proposer: openai` pointing at the scripted
server, for a spec the rules proposer cannot trace (only a PyTorch reference). The population holds
the accepted candidates (a repair among them), and the proposer's JSONL log records the rejection."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cubridge.search.screen import ScreenContext
from cubridge.transfer.proposer import RulesProposer

pytest.importorskip("cubridge.search.tuner", reason="the tuner (cubridge-tune) is not in this checkout")

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
sys.path.insert(0, str(SUPPORT))
from scripted import ScriptedServer, completion, envelope, inline_scalars  # noqa: E402


def test_tune_dry_run_with_the_openai_proposer(tmp_path):
    prefixlm = RulesProposer(ScreenContext.build("fa2_sm80", "prefixlm")).ask(1)[0].text
    good = inline_scalars(prefixlm, {"C0": "NK // 2"})
    wrong = inline_scalars(prefixlm, {"C0": "NK // 4"})          # a prefix of N/4, not N/2
    repaired = good.replace("as CuIR.", "as CuIR (repaired).")
    assert len({good, wrong, repaired}) == 3
    script = [{"choices": [completion(envelope(good)), completion(envelope(wrong))]},
              {"choices": [completion(envelope(repaired))]}]
    out = tmp_path / "run"
    with ScriptedServer(tmp_path, script) as srv:
        config = tmp_path / "llm.yaml"
        config.write_text(f"""
spec: {SUPPORT / 'specs' / 'prefixlm_reference_only.py'}
reference: fa2_sm80
arch: sm_80
dtype: bf16
shapes: {{heads_q: 4, heads_kv: 2, head_dim: 64, lengths: [1024]}}
proposer:
  kind: openai
  population: 2
  options: {{base_url: "{srv.base_url}", samples: 2, max_retries: 1, backoff_s: 0.01, out_dir: "{out / 'llm'}"}}
runner: {{kind: local, timeout_s: 120}}
budget: {{trials: 2, minutes: 1}}
output: {out}
""")
        run = subprocess.run([sys.executable, "-m", "cubridge.cli", "tune", str(config), "--dry-run"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        posts = srv.requests()
    assert run.returncode == 0, run.stderr[-3000:]
    population = json.loads((out / "population.json").read_text())
    screened = json.loads((out / "screen.json").read_text())
    states = {c["id"]: screened[c["id"]]["state"] for c in population}
    assert sorted(states.values()) == ["verified", "verified", "wrong_answer"]
    assert all(c["origin"] == "openai" for c in population)
    [fix] = [c for c in population if c["attempt"] == 1]
    assert states[fix["id"]] == "verified" and states[fix["parent"]] == "wrong_answer"
    assert len(posts) == 2 and posts[0]["n"] == 2
    assert screened[fix["parent"]]["reason"] in posts[1]["messages"][-1]["content"]
    log = [json.loads(line) for line in (out / "llm" / "llm-openai.jsonl").read_text().splitlines()]
    assert [e["state"] for e in log if e["event"] == "rejected"] == ["wrong_answer"]
    assert sum(e["event"] == "accepted" for e in log) == 2


def test_llm_and_rules_candidates_share_one_population(tmp_path):
    """With a traceable spec, the population holds the rules transfer beside the model's answers."""
    prefixlm = RulesProposer(ScreenContext.build("fa2_sm80", "prefixlm")).ask(1)[0].text
    good = inline_scalars(prefixlm, {"C0": "NK // 2"})
    script = [{"choices": [completion(envelope(good))]}]
    out = tmp_path / "run"
    with ScriptedServer(tmp_path, script) as srv:
        config = tmp_path / "mix.yaml"
        config.write_text(f"""
spec: prefixlm
reference: fa2_sm80
arch: sm_80
dtype: bf16
shapes: {{heads_q: 4, heads_kv: 2, head_dim: 64, lengths: [1024]}}
proposer:
  kind: openai
  population: 2
  options: {{base_url: "{srv.base_url}", samples: 1, max_retries: 0, backoff_s: 0.01}}
runner: {{kind: local, timeout_s: 120}}
budget: {{trials: 2, minutes: 1}}
output: {out}
""")
        run = subprocess.run([sys.executable, "-m", "cubridge.cli", "tune", str(config), "--dry-run"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    population = json.loads((out / "population.json").read_text())
    screened = json.loads((out / "screen.json").read_text())
    assert sorted(c["origin"] for c in population) == ["openai", "rules"]
    assert all(screened[c["id"]]["state"] == "verified" for c in population)
    assert (out / "llm" / "llm-openai.jsonl").is_file()        # the log defaults to <output>/llm
