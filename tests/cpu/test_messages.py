"""The driver -> worker message (cubridge.search.messages.KernelJob): frozen, its JSON reads back
equal (binding data included, so a worker never redoes the transfer), and a key the worker does not
know is refused with the reason (a driver and a worker of different checkouts)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cubridge.cuir.parser import parse_file
from cubridge.errors import CubridgeError
from cubridge.paths import ref_kernel_dir
from cubridge.search.messages import KernelJob, TargetShape
from cubridge.spec import load_spec
from cubridge.transfer.rules import transfer


@pytest.fixture(scope="module")
def job():
    cand = transfer(parse_file(ref_kernel_dir("fa3_sm90") / "kernel.cuir"), load_spec("document"))
    return KernelJob(candidate="c0", reference="fa3_sm90", origin="rules", text="...", spec="document",
                     spec_params={}, head_dim=128, heads_q=8, heads_kv=2, dtype="bf16", arch="sm_90a",
                     shapes=(TargetShape("N=1024,B=16", 16, 1024), TargetShape("N=8192,B=2", 2, 8192, 4096)),
                     config={"block_m": 128, "block_n": 128}, binding=cand.binding.to_json(), trial=3)


def test_a_job_reads_back_equal_through_json(job):
    back = KernelJob.from_json(json.loads(json.dumps(job.to_json())))
    assert back == job and back.shapes[1].nq == 4096 and back.binding


def test_a_job_is_frozen(job):
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.config = None


def test_an_unknown_key_is_refused_unless_the_wrapping_job_names_it(job):
    d = {**job.to_json(), "bwd_configs": ["a"]}
    with pytest.raises(CubridgeError, match=r"unknown keys \['bwd_configs'\](.|\n)*same cubridge checkout"):
        KernelJob.from_json(d)
    assert KernelJob.from_json(d, ("bwd_configs",)) == job
