"""cubridge: expert CUDA attention kernels, lifted into CuIR, transferred to new variants.

The pipeline: spec (PyTorch) -> transfer (CuIR) -> verify (interpreter) -> lower (CUDA) -> tune.
See README.md for the commands and docs/DESIGN.md for the architecture.
"""
from cubridge.errors import CubridgeError
from cubridge.load import load
from cubridge.version import __version__
__all__ = ["CubridgeError", "__version__", "load"]
