#!/usr/bin/env bash
# The GPU runner: one device call runs a job file's jobs, in parallel where they may (nvcc is the
# bottleneck: the device has 16 cores), each under its own time limit and all under one deadline;
# results are written as each job ends, so a call cut short still reports what finished.
#
#   usage (repo root, GPU):  DEADLINE_S=420 bash experiments/device_jobs.sh JOBFILE
#   JOBFILE lines:  NAME<TAB>SECONDS<TAB>COMMAND   (# comments and blank lines ignored); a NAME
#   starting with '!' runs alone (timings: every earlier job has ended, no later one starts until
#   it ends). Reusable job files: experiments/jobs/; a session's own: experiments/sN_*.txt.
#
# Writes $OUT/$JOBS_NAME.log (every job's tail, in the order they end) and $OUT/$JOBS_NAME.json (per
# job: rc, seconds, pytest's summary line, the failed test ids), both rewritten after each job ends.
# JOBS_NAME is "jobs" unless set (experiments/device_s8.sh, the old name, sets "s8").
set -uo pipefail
OUT=${OUT:-/tmp/jobs_out}; mkdir -p "$OUT"; export OUT
JOBS_NAME=${JOBS_NAME:-jobs}
JOBS=${1:?name a job file}
DEADLINE_S=${DEADLINE_S:-420}
PARALLEL=${PARALLEL:-3}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
START=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} > "$WORK/env.txt" 2>&1
cp "$WORK/env.txt" "$OUT/$JOBS_NAME.log"

collect() {   # rebuild $JOBS_NAME.json and .log from the finished jobs
  python3 - "$WORK" "$OUT" "$JOBS_NAME" <<'EOF'
import json, pathlib, re, sys, datetime
work, out, name = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
env = (work / "env.txt").read_text().splitlines()
jobs = []
for d in sorted(work.glob("job_*"), key=lambda p: p.stat().st_mtime):
    if not (d / "rc").exists():
        continue
    log = (d / "log").read_text(errors="replace")
    summary = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
    jobs.append({"name": (d / "name").read_text().strip(), "rc": int((d / "rc").read_text() or -1),
                 "seconds": float((d / "secs").read_text() or 0),
                 "summary": summary[-1].strip("= ") if summary else None,
                 "failed": sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))[:60]})
json.dump({"device": env[0] if env else None, "versions": env[1:], "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "jobs": jobs}, open(out / f"{name}.json", "w"), indent=1)
with open(out / f"{name}.log", "w") as f:
    f.write("\n".join(env) + "\n")
    for d in sorted(work.glob("job_*"), key=lambda p: p.stat().st_mtime):
        if (d / "rc").exists():
            f.write(f"\n=== {(d / 'name').read_text().strip()} rc={(d / 'rc').read_text().strip()} "
                    f"{(d / 'secs').read_text().strip()}s\n")
            f.write("\n".join((d / "log").read_text(errors="replace").splitlines()[-int(80):]) + "\n")
EOF
}

run_job() {   # run_job INDEX NAME SECONDS COMMAND
  local d="$WORK/job_$1" t0; mkdir -p "$d"; echo "$2" > "$d/name"; t0=$(date +%s)
  local left=$((DEADLINE_S - (t0 - START) - 10)); local t=$(( $3 < left ? $3 : left ))
  if [ "$left" -lt 20 ]; then echo "skipped: ${left}s left of the call" > "$d/log"; echo 124 > "$d/rc"
  else timeout "$t" bash -c "$4" > "$d/log" 2>&1; echo $? > "$d/rc"; fi
  echo $(( $(date +%s) - t0 )) > "$d/secs"
  echo "[$(( $(date +%s) - START ))s] $2 rc=$(cat "$d/rc") $(grep -E '[0-9]+ (passed|failed)' "$d/log" | tail -1)"
}

i=0
while IFS=$'\t' read -r name secs cmd; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  if [[ "$name" == !* ]]; then
    wait; collect; i=$((i + 1)); run_job "$i" "${name#!}" "$secs" "$cmd" < /dev/null; collect; continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; collect; done
  i=$((i + 1)); run_job "$i" "$name" "$secs" "$cmd" < /dev/null &
done < "$JOBS"
wait; collect
echo; echo "=== table ($(( $(date +%s) - START ))s)"
python3 -c "
import json; d = json.load(open('$OUT/$JOBS_NAME.json'))
for j in d['jobs']: print(f\"{j['name']:<28} rc={j['rc']:<4} {j['seconds']:>5.0f}s  {j['summary'] or ''}\")"
