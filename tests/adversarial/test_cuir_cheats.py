"""Every CuIR cheat of the corpus (cuir_cheats.py) is rejected on CPU, with its reason: by the
static check or by the interpreter verification the tuner's screen runs (default cases plus the
tile config's deep cases), or - for a cheat that hides at other tile configs - by the check every
trial's config gets before it is timed (jobs.verify_at_config does the same at that config)."""
from __future__ import annotations

import pytest

from cubridge.cuir.checker import check
from cubridge.cuir.parser import parse
from cubridge.errors import CubridgeError
from cubridge.spec import load_spec
from cubridge.verify import deep_cases, default_cases, verify_program

from cuir_cheats import CHEATS, FA2, STRICT_CAUSAL, apply

D = 16
OTHER_CONFIG = {"BLOCK_N": 32}       # a config the tuner may time (fa2_sm80's space has block_n 32)


@pytest.fixture(scope="module")
def strict_causal(tmp_path_factory):
    path = tmp_path_factory.mktemp("specs") / "strict_causal.py"
    path.write_text(STRICT_CAUSAL)
    return load_spec(str(path))


def rejection(text: str, spec, binder=None) -> str | None:
    """What rejects the program (None: nothing did): static check, screen cases, another config."""
    try:
        prog = parse(text, source="<cheat>")
        check(prog, dims={"D": D})
    except CubridgeError as e:
        return f"static: {e}"
    for params in ({}, OTHER_CONFIG):
        cases = default_cases(D, quick=True) + deep_cases({**prog.params(), **params}, D)
        rep = verify_program(prog, spec, params=params, cases=cases, binder=binder and (lambda c: binder(c, params)))
        bad = rep.first_failure
        if bad is not None:
            return f"at {params or 'the default config'}, {bad.case}: {bad.error or bad.verdict.reason}"
    return None


@pytest.mark.parametrize("name, base, edits, spec_name, words", CHEATS, ids=[c[0] for c in CHEATS])
def test_cheat_is_rejected_with_its_reason(name, base, edits, spec_name, words, strict_causal):
    binder = None
    if spec_name == "strict_causal":      # the cheat edits the rules transfer of a spec with empty rows
        from cubridge.transfer.rules import transfer
        cand = transfer(parse(base), strict_causal)
        base, spec = cand.text, strict_causal
        binder = lambda c, params: cand.bind(Nq=c.Nq, Nk=c.Nk, Hq=c.Hq, Hkv=c.Hkv, B=c.B, params=params)  # noqa: E731
        assert rejection(base, spec, binder) is None, "the honest transfer must pass"
    else:
        spec = load_spec(spec_name)
    why = rejection(apply(base, edits), spec, binder)
    assert why is not None, f"{name} was not rejected"
    for w in words:
        assert w in why, why


def test_the_unedited_programs_pass():
    assert rejection(FA2, load_spec("causal")) is None
