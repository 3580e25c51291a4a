"""Kept for code written before the move: the proposer registry lives in cubridge.registry (the
bottom layer, docs/DESIGN.md "Layers"). New code imports it from there."""
from cubridge.registry import available, make_proposer, register

__all__ = ["available", "make_proposer", "register"]
