"""experiments/expkit/hosttime.py, the op's host-time protocol (bench_op, op_host_breakdown): rounds
interleave the callables in different orders, each callable's number is the median of its round
medians (one bad window cannot decide it), and pinning leaves the process's CPU set as it was.
The GPU side (torch.cuda._sleep / synchronize) is replaced by a recorded window."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "experiments" / "expkit" / "hosttime.py"


@pytest.fixture()
def hosttime():
    spec = importlib.util.spec_from_file_location("cubridge_tests_hosttime", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)        # not put in sys.modules: nothing outlives the test
    return module


def test_rounds_interleave_in_different_orders(hosttime):
    orders = hosttime.orders(["a", "b", "c", "d"], 5, seed=3)
    assert orders[0] == ["a", "b", "c", "d"] and orders[1] == ["d", "c", "b", "a"]
    assert all(sorted(o) == ["a", "b", "c", "d"] for o in orders)
    assert orders == hosttime.orders(["a", "b", "c", "d"], 5, seed=3)       # seeded: a rerun times alike


def test_one_bad_window_does_not_decide_a_callable(hosttime, monkeypatch):
    """Each window's per-call times come from the fake: 'op' has one slow round (25 us, as session
    12's single-window rows read at random) among 15 us ones; the median of rounds says 15."""
    seen = []

    def window(fn, calls=hosttime.CALLS):
        name = fn()
        seen.append(name)
        slow = name == "op" and seen.count("op") == 2
        return [25.0 if slow else {"op": 15.0, "launch": 5.0}[name]] * 7 + [90.0]   # one outlier call
    monkeypatch.setattr(hosttime, "window", window)
    before = os.sched_getaffinity(0)
    table = hosttime.rounds({"op": lambda: "op", "launch": lambda: "launch"}, n_rounds=5, pin=True)
    assert os.sched_getaffinity(0) == before
    assert seen[:4] == ["op", "launch", "launch", "op"]
    op = table["op"]
    assert op["rounds_us"] == [15.0, 25.0, 15.0, 15.0, 15.0] and op["median_us"] == 15.0 and op["spread_us"] == 10.0
    assert table["launch"]["median_us"] == 5.0 and op["mean_us"] == pytest.approx((7 * 15 * 4 + 7 * 25 + 5 * 90) / 40, abs=0.01)
    assert len(op["calib_us"]) == 5 and all(c > 0 for c in op["calib_us"]) and len(op["cpu"]) == 5
