"""Transfer: a spec's hooks -> target CuIR, through the rule taxonomy (rules proposer)."""
# The tracer's operator table registers itself into trace.py (trace.register_ops) when its module
# is imported; importing it here makes it present before any hook is traced.
from cubridge.transfer import trace_table  # noqa: F401
