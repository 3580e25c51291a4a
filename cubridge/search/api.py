"""Kept for code written before the move: the shared vocabulary lives in cubridge.vocab (the
bottom layer, docs/DESIGN.md "Layers"). New code imports it from there."""
from cubridge.vocab import Job, JobResult, Outcome, Proposal, Proposer, Runner, TrialRecord, TrialState

__all__ = ["Job", "JobResult", "Outcome", "Proposal", "Proposer", "Runner", "TrialRecord", "TrialState"]
