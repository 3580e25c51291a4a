"""The tuned kernel as a PyTorch op: `cubridge.load(DIR)` returns a `TunedOp` (cubridge/op/tuned.py);
`build` writes a run directory straight from default tile configs (no Optuna, no timing), for
machines that cannot tune (cubridge/op/build.py). Nothing here imports torch until it is used."""

__all__ = ["TunedOp", "build"]

# The submodule first (it imports no torch): loaded later, by build() or any `import
# cubridge.op.build`, it rebound the package's `build` to itself, so `from cubridge.op import
# build` gave the function or the module depending on what ran before (a shuffled CI order failed
# test_op's build test after test_reference_kernels imported cubridge.op.build).
from cubridge.op import build as _build_module  # noqa: E402,F401


def build(*args, **kwargs):
    """See cubridge.op.build.build_run."""
    from cubridge.op.build import build_run
    return build_run(*args, **kwargs)


def __getattr__(name):
    if name == "TunedOp":
        from cubridge.op.tuned import TunedOp
        return TunedOp
    raise AttributeError(name)
