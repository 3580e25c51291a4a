"""Trials per minute of `cubridge-tune` through the Ray runner on 1 GPU and on 2, one machine.

    python experiments/ray_scaling.py --out $OUT/ray_scaling.json

Runs experiments/configs/ray_scaling_prefixlm.yaml twice in fresh processes (CUDA_VISIBLE_DEVICES=0,
then 0,1; each run has its own output directory, so both start with a cold compile cache) and
reads each run's trials.jsonl: rate = (measured trials - workers) / (last finish - first finish),
the steady-state rate of the search loop (setup, transfer and the final bench excluded; the first
trial of each worker finishes together, so it is not counted). Also records
which worker ran each trial, to show that both GPUs took work.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "ray_scaling_prefixlm.yaml"


def one_run(gpus: str, out_dir: Path) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "cubridge.cli", "tune", str(CONFIG), "--out", str(out_dir)],
                          env=env, capture_output=True, text=True)
    wall = time.time() - start
    print(proc.stdout[-1500:], proc.stderr[-1500:], sep="\n", flush=True)
    recs = [json.loads(line) for line in (out_dir / "trials.jsonl").read_text().splitlines() if line.strip()]
    measured = sorted((r for r in recs if r["outcome"]["state"] != "config_invalid"), key=lambda r: r["finished_at"])
    span = measured[-1]["finished_at"] - measured[0]["finished_at"] if len(measured) > 1 else float("nan")
    return {"gpus": len(gpus.split(",")), "rc": proc.returncode, "wall_s": round(wall, 1),
            "measured": len(measured), "states": dict(Counter(r["outcome"]["state"] for r in recs)),
            "workers": dict(Counter(r["worker"] for r in measured)), "span_s": round(span, 1),
            "trials_per_min": (round(60 * (len(measured) - len(gpus.split(","))) / span, 2)
                               if span == span and span > 0 else None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    runs = [one_run("0", args.out.parent / "ray_1gpu"), one_run("0,1", args.out.parent / "ray_2gpu")]
    one, two = runs
    res = {"gpu": torch.cuda.get_device_name(), "gpus_on_machine": torch.cuda.device_count(),
           "date": str(date.today()), "torch": torch.__version__, "config": str(CONFIG), "runs": runs,
           "speedup_trials_per_min": (round(two["trials_per_min"] / one["trials_per_min"], 2)
                                      if one["trials_per_min"] and two["trials_per_min"] else None)}
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
