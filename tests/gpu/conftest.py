"""tests/gpu needs a CUDA GPU: without one every test here is skipped, with the reason shown."""
import pytest
import torch

GPU_REASON = "tests/gpu needs a CUDA GPU: torch.cuda.is_available() is False on this machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
