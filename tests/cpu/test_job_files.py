"""GPU job files (experiments/jobs/*.txt, experiments/sN_*.txt) and their runner
(experiments/device_jobs.sh), checked without a GPU: every line NAME<TAB>SECONDS<TAB>COMMAND, and in
the reusable and current files every script, test file and config named exists and every option
given to an experiments/ script is one it defines. A job file is run once per session on a
borrowed GPU: a typo found there costs the whole call. The runner itself runs a small job file."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
ALL = sorted(EXPERIMENTS.glob("s*.txt")) + sorted((EXPERIMENTS / "jobs").glob("*.txt"))
# Files whose commands must still run: the reusable ones and this session's (older sessions' files
# are the record of what ran then; the scripts they name may have changed since).
CURRENT = sorted((EXPERIMENTS / "jobs").glob("*.txt")) + sorted(EXPERIMENTS.glob("s1[0-9]_*.txt"))
PATH = re.compile(r"\b(?:experiments|tests|configs)/[\w./-]+\.(?:py|sh|yaml|txt)\b")


def jobs(path: Path) -> list[tuple[int, str, str, str]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            out.append((i, *(line.split("\t") + ["", "", ""])[:3]) if line.count("\t") == 2 else (i, line, "", ""))
    return out


def _ids(files):
    return [p.relative_to(EXPERIMENTS).as_posix() for p in files]


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_every_line_is_name_seconds_command(path):
    names = []
    for i, name, secs, cmd in jobs(path):
        where = f"{path.name}:{i}"
        assert re.fullmatch(r"!?[A-Za-z0-9_.-]+", name) and cmd, f"{where}: not NAME<TAB>SECONDS<TAB>COMMAND"
        assert secs.isdigit() and 0 < int(secs) <= 600, f"{where}: SECONDS {secs!r} is not 1..600"
        names.append(name.lstrip("!"))
    assert len(names) == len(set(names)), f"{path.name}: a job name repeats"


def _script_options(cmd: str) -> list[tuple[str, str]]:
    """(script, --option) for each `python3 experiments/X.py ... --option` in a command."""
    out = []
    for segment in re.split(r"\|\||&&|[|;]", cmd):
        try:
            words = shlex.split(segment)
        except ValueError:
            words = segment.split()
        for j, w in enumerate(words):
            if w.startswith("experiments/") and w.endswith(".py") and j and words[j - 1].startswith("python"):
                out += [(w, o.split("=")[0]) for o in words[j + 1:] if re.fullmatch(r"--[a-z][\w-]*(=.*)?", o)]
    return out


@pytest.mark.parametrize("path", CURRENT, ids=_ids(CURRENT))
def test_current_job_files_name_what_exists(path):
    for i, _, _, cmd in jobs(path):
        for rel in PATH.findall(cmd):
            assert (ROOT / rel).exists(), f"{path.name}:{i}: {rel} does not exist"
        for script, option in _script_options(cmd):
            assert _defines(script, option), f"{path.name}:{i}: {script} has no {option}"


def _defines(script: str, option: str) -> bool:
    """The script's source names `option` (or, for --no-X, --X: argparse.BooleanOptionalAction)."""
    text = (ROOT / script).read_text()
    names = [option] + ([option.replace("--no-", "--", 1)] if option.startswith("--no-") else [])
    return any(f'"{n}"' in text or f"'{n}'" in text for n in names)


def test_the_option_check_can_fail():
    assert _script_options("set -o pipefail; python3 experiments/bench_op.py --out $OUT/x.json --nope 2>&1 | tail") == \
        [("experiments/bench_op.py", "--out"), ("experiments/bench_op.py", "--nope")]
    assert not _defines("experiments/bench_op.py", "--nope") and _defines("experiments/bench_op.py", "--out")
    assert _defines("experiments/ab_peer_patches.py", "--no-grid")        # BooleanOptionalAction's negative form


def test_the_runner_runs_a_job_file(tmp_path):
    """Parallel jobs, a '!' job alone, a job past its limit (rc 124), pytest's summary and failures
    picked from the log, both result files named by JOBS_NAME; the alias keeps the old names."""
    jobfile = tmp_path / "jobs.txt"
    jobfile.write_text("# a comment\n\nok\t30\techo '3 passed in 1.0s'\n"
                       "!alone\t30\techo 'FAILED tests/gpu/test_x.py::test_y - boom'; echo '1 failed'; exit 1\n"
                       "slow\t1\tsleep 30\n")
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DEADLINE_S": "60", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(EXPERIMENTS / "device_jobs.sh"), str(jobfile)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "out" / "jobs.json").read_text())
    got = {j["name"]: (j["rc"], j["summary"], j["failed"]) for j in res["jobs"]}
    assert got == {"ok": (0, "3 passed in 1.0s", []), "alone": (1, "1 failed", ["tests/gpu/test_x.py::test_y"]),
                   "slow": (124, None, [])}
    assert "=== alone rc=1" in (tmp_path / "out" / "jobs.log").read_text()
    assert proc.stdout.splitlines()[-1].startswith("slow") or "slow" in proc.stdout.split("=== table")[1]
    env["OUT"] = str(tmp_path / "old")
    subprocess.run(["bash", str(EXPERIMENTS / "device_s8.sh"), str(jobfile)], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=120, check=True)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["s8.json", "s8.log"]
