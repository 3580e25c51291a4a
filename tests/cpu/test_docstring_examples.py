"""The runnable examples in the docstrings of the modules below (the house style: a public function
carries one); each module's examples run as written."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["cubridge.archs", "cubridge.rule", "cubridge.runtime.timing", "cubridge.runtime.kernels",
           "cubridge.runtime.kernels.fa2_sm80", "cubridge.runtime.kernels.fa3_sm90", "cubridge.search.space",
           "cubridge.transfer.rules"]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
