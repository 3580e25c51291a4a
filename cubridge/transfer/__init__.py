"""Transfer: a spec's hooks -> target CuIR, through the rule taxonomy (rules proposer)."""
