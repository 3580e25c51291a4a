"""The tuned kernel as a PyTorch op: `cubridge.load(DIR)` returns a `TunedOp`; `build` writes a
run directory straight from default tile configs (no Optuna, no timing), for machines that
cannot tune (cubridge/op/build.py)."""
from cubridge.op.tuned import TunedOp

__all__ = ["TunedOp", "build"]


def build(*args, **kwargs):
    """See cubridge.op.build.build_run."""
    from cubridge.op.build import build_run
    return build_run(*args, **kwargs)
