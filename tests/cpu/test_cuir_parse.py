"""CuIR parser and printer: round trips, and every forbidden construct rejected with its line and
a message that says what is allowed instead."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubridge.cuir import nodes as N
from cubridge.cuir.parser import parse, parse_file
from cubridge.cuir.printer import to_text
from cubridge.errors import CuIRSyntaxError
from cubridge.paths import ref_kernel_dir

PROGRAMS = ("fa2_sm80", "fa3_sm90")


def _round_trip(p: N.Program) -> None:
    text = to_text(p)
    again = parse(text)
    assert again == p
    assert to_text(again) == text


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", PROGRAMS)
def test_reference_programs_round_trip(name):
    path = ref_kernel_dir(name) / "kernel.cuir"
    p = parse_file(path)
    assert p.name == name
    assert p.source == str(path)
    _round_trip(p)
    # The reference programs are written in canonical form up to the quote style: printing gives
    # the file back line for line (so error lines in printed text are the file's lines).
    assert to_text(p).replace("'", '"') == path.read_text()


@pytest.mark.parametrize("name", PROGRAMS)
def test_reference_programs_differ_when_text_differs(name):
    text = (ref_kernel_dir(name) / "kernel.cuir").read_text()
    old = "STAGES=2"
    assert old in text
    assert parse(text.replace(old, "STAGES=3")) != parse(text)


SNIPPETS = {
    "precedence": "x = (a + b) * c - d / (e - f) // g % h\ny = a - (b - c) - d\nz = -(a * b) + -c\n",
    "bool_and_compare": "t = (a < b) & (c >= d) | (e != f) ^ ~g\nu = a and (b or c) and not d\n"
                        "v = not a < b\nw = (not a) < b\n",
    "ifexp": "x = a if c else b if d else e\ny = (a if c else b) + 1\nz = (a if c else b) if d else e\n",
    "negative_consts": "x = -1 + a - -2.5 * b\ny = a - -1\nz = ~-1\nw = -True\n",
    "calls_and_subscripts": 'kernel("k", arch="sm_90a")\nparam(BLOCK_M=128, CAUSAL=1, SCALE=0.5)\n'
                            "Q = global_input(T, [B, H, N, D])\nm, h, b = grid(cdiv(N, BLOCK_M), H, B)\n"
                            "bar = mbarrier(count=2, n=STAGES)\nx = load(Q[b, h, m * BLOCK_M:m * BLOCK_M + BLOCK_M, :])\n"
                            "y = Q[:, 0, :4, 1:]\nstore(Q[b, h, 0:4, :], cast(x, T))\n",
    "control": "for i in range(n):\n    for j in range(1, n):\n        for k in range(0, n, 2):\n"
               "            x += i * j\n    if i < 2:\n        y = 1\n    elif i < 3:\n        y = 2\n"
               "    else:\n        y = 3\n        if y:\n            z = 0\n",
    "roles": 'with role("producer", warps=4):\n    with region("load_kv"):\n        arrive(e[0])\n'
             'with role("consumer", warps=4, count=CONSUMERS) as wg:\n    with region("qk"):\n'
             "        wait(e[wg], 0)\n",
    "docs": '"""multi\nline doc"""\nx = 1\n"single"\nwith region("mask"):\n    "inner doc"\n    y = 2\n',
}


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippets_round_trip(name):
    p = parse(SNIPPETS[name])
    _round_trip(p)


def test_canonical_text_is_fixed_point_of_noncanonical_input():
    p = parse("x = ((a) + (b))\ny = +a\nfor i in range(0, n, 1):\n    z = -(1)\n")
    text = to_text(p)
    assert text == "x = a + b\ny = a\nfor i in range(n):\n    z = -1\n"
    _round_trip(p)


def test_constants_keep_their_type():
    # 1, 1.0 and True are == in Python but not the same CuIR program (int / float / bool scalars).
    assert parse("x = a * 1\n") != parse("x = a * 1.0\n")
    assert parse("x = a * 1\n") != parse("x = a * True\n")
    assert len({N.Const(1), N.Const(1.0), N.Const(True)}) == 3
    assert N.Const(-0.0) == N.Const(0.0) and N.Const("a", line=3) == N.Const("a", line=9)
    _round_trip(N.Program((N.For("i", N.Const(0), N.Name("n"), N.Const(1.0), (N.Assign(("y",), N.Name("i")),)),)))
    _round_trip(N.Program((N.Role("r", N.Const(4), N.Const(True), None, (N.Assign(("y",), N.Const(1)),)),)))


@pytest.mark.parametrize("text", ["a\nb\\tc", "a\r\nb", "x\n\x00y", "ends with quote\n\"", 'has """ inside\n',
                                  "tab\tand\nnewline", "caf\u00e9\nok"])
def test_doc_texts_round_trip(text):
    _round_trip(N.Program((N.Doc(text), N.Assign(("x",), N.Const(1)))))


def test_empty_block_prints_idempotently():
    p = N.Program((N.If(N.Name("x"), (), ()),))
    text = to_text(p)
    assert to_text(parse(text)) == text


# ------------------------------------------------------------------ random expression and statement trees
_NAMES = st.sampled_from(["a", "b", "x", "BLOCK_M", "D", "inf", "T", "q0"])
_CONSTS = st.one_of(
    st.integers(-10**6, 10**6), st.booleans(), st.none(), st.text(max_size=4),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
).map(N.Const)
_BINOPS = ["+", "-", "*", "/", "//", "%", "&", "|", "^"]
_CMPS = ["<", "<=", ">", ">=", "==", "!="]


def _numeric_const(e) -> bool:
    return isinstance(e, N.Const) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool)


def _extend(children):
    unary = st.tuples(st.sampled_from(["-", "not", "~"]), children).filter(
        lambda t: not (t[0] == "-" and _numeric_const(t[1]))).map(lambda t: N.UnaryOp(*t))
    index_item = st.one_of(
        children,
        st.builds(N.Slice, st.none() | children, st.none() | children),
    )
    call = st.one_of(
        st.builds(lambda a: N.Call("exp", (a,)), children),
        st.builds(lambda a, b: N.Call("maximum", (a, b)), children, children),
        st.builds(lambda c, a, b: N.Call("where", (c, a, b)), children, children, children),
        st.builds(lambda a, b, c: N.Call("mma", (a, b) + c), children, children, st.tuples() | st.tuples(children)),
        st.builds(lambda c, n: N.Call("mbarrier", (), (("count", c),) + n), children,
                  st.tuples() | st.tuples(st.just("n"), children).map(lambda t: (t,))),
    )
    return st.one_of(
        st.builds(N.BinOp, st.sampled_from(_BINOPS), children, children),
        unary,
        st.builds(N.Compare, st.sampled_from(_CMPS), children, children),
        st.builds(N.BoolOp, st.sampled_from(["and", "or"]), st.lists(children, min_size=2, max_size=3).map(tuple)),
        st.builds(N.IfExp, children, children, children),
        call,
        st.builds(N.Subscript, _NAMES.map(N.Name), st.lists(index_item, min_size=1, max_size=3).map(tuple)),
        st.builds(N.Seq, st.lists(children, max_size=3).map(tuple)),
    )


EXPRS = st.recursive(st.one_of(_NAMES.map(N.Name), _CONSTS), _extend, max_leaves=12)
_TARGETS = st.sampled_from(["y", "acc", "m_i", "st"])


def _stmts(children_blocks):
    block = st.lists(children_blocks, min_size=1, max_size=3).map(tuple)
    return st.one_of(
        st.builds(N.For, _TARGETS, EXPRS, EXPRS, EXPRS, block),
        st.builds(N.If, EXPRS, block, st.just(()) | block),
        st.builds(N.Region, st.sampled_from(N.REGIONS), block),
        st.builds(N.Role, st.text(max_size=6), EXPRS, EXPRS, st.none() | _TARGETS, block),
    )


SIMPLE_STMTS = st.one_of(
    st.builds(N.Assign, st.lists(_TARGETS, min_size=1, max_size=3).map(tuple), EXPRS),
    st.builds(N.AugAssign, _TARGETS, st.sampled_from(_BINOPS), EXPRS),
    st.builds(lambda d, v: N.ExprStmt(N.Call("store", (d, v))), EXPRS, EXPRS),
    st.just(N.ExprStmt(N.Call("sync"))),
    st.builds(N.Doc, st.text(max_size=12) | st.text(st.sampled_from('ab"\'\n\\\r\t\x00 '), max_size=12)),
)
STMTS = st.recursive(SIMPLE_STMTS, _stmts, max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EXPRS)
def test_random_expression_round_trip(e):
    _round_trip(N.Program((N.Assign(("y",), e),)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STMTS, min_size=1, max_size=4).map(tuple))
def test_random_statement_round_trip(body):
    _round_trip(N.Program(body))


# ------------------------------------------------------------------ rejected input
HEAD = 'kernel("k")\nQ = global_input(T, [B, D])\n'     # lines 1-2; the offending line is 3 unless said


BAD = [
    # (id, offending text, offending line, words the message or hint must contain)
    ("syntax_error", "x = (1 +\n", 3, ["syntax error", "subset of Python"]),
    ("import", "import os\n", 3, ["Import", "imports are not CuIR"]),
    ("from_import", "from x import y\n", 3, ["ImportFrom", "imports are not CuIR"]),
    ("attribute", "n = Q.shape\n", 3, [".shape", "no attributes"]),
    ("method_call", "y = x.sum()\n", 3, [".sum(", "call the op function"]),
    ("exec", 'exec("import os")\n', 3, ["exec", "not CuIR"]),
    ("eval", 'x = eval("1")\n', 3, ["eval", "not CuIR"]),
    ("open", 'f = open("/etc/passwd")\n', 3, ["open", "not CuIR"]),
    ("dunder", "x = __class__\n", 3, ["__class__", "dunder"]),
    ("dunder_target", "__x = 1\n", 3, ["__x", "dunder"]),
    ("unknown_op", "y = foo(x)\n", 3, ["unknown op 'foo'", "allowed ops:", "mma_async", "row_max"]),
    ("too_many_args", "y = exp(x, x)\n", 3, ["exp() takes 1 argument(s), got 2", "signature: exp(x)"]),
    ("too_few_args", "y = where(c, x)\n", 3, ["where() takes 3", "got 2", "where(cond, a, b)"]),
    ("optional_arg", "y = mma(a)\n", 3, ["mma() takes 2 to 3", "acc=None"]),
    ("unknown_keyword", "y = zeros(f32, [4, 4], fill=1)\n", 3, ["unknown keyword 'fill'", "keywords of zeros: none"]),
    ("unknown_keyword_mbarrier", "y = mbarrier(count=1, size=2)\n", 3, ["'size'", "count, n"]),
    ("while", "while x:\n    y = 1\n", 3, ["While", "use `for i in range"]),
    ("def", "def f():\n    y = 1\n", 3, ["FunctionDef", "function definitions are not CuIR"]),
    ("lambda", "f = lambda: 1\n", 3, ["Lambda", "lambdas are not CuIR"]),
    ("list_comprehension", "f = [i for i in range(3)]\n", 3, ["ListComp", "comprehensions"]),
    ("generator", "f = cdiv(i for i in range(3))\n", 3, ["comprehensions"]),
    ("dict_comprehension", "f = {i: i for i in range(3)}\n", 3, ["comprehensions"]),
    ("chained_compare", "f = a < b < c\n", 3, ["chained comparisons", "(a < b) & (b < c)"]),
    ("with_open", 'with open("x") as f:\n    y = 1\n', 3, ["role(...) or a region(...)", "with region"]),
    ("with_other", 'with foo("x"):\n    y = 1\n', 3, ["role(...) or a region(...)"]),
    ("unknown_region", 'with region("bogus"):\n    y = 1\n', 3, ["unknown region 'bogus'", "softmax", "epilogue"]),
    ("region_extra_arg", 'with region("qk", 2):\n    y = 1\n', 3, ["region takes only its name"]),
    ("role_no_warps", 'with role("p"):\n    y = 1\n', 3, ["warps="]),
    ("subscript_assign", "Q[0, 0] = 1\n", 3, ["subscript", "store("]),
    ("empty_index", "y = Q[()]\n", 3, ["empty index"]),
    ("for_not_range", "for i in x:\n    y = 1\n", 3, ["range(...)"]),
    ("tuple_value", "y = (1, 2)\n", 3, ["tuple", "list literal"]),
    ("pow", "y = a ** 2\n", 3, ["Pow", "allowed"]),
    ("fstring", 'y = f"{a}"\n', 3, ["f-strings"]),
    ("walrus", "y = (z := 1)\n", 3, ["walrus"]),
    ("try", "try:\n    y = 1\nexcept E:\n    y = 2\n", 3, ["Try"]),
    ("bare_expression", "a + 1\n", 3, ["op call"]),
    ("range_outside_for", "y = range(3)\n", 3, ["range(...) is only allowed"]),
    ("nested_error_line", "for i in range(n):\n    if i:\n        y = x.T\n", 5, [".T"]),
    ("multiline_call", "y = maximum(\n    a,\n    foo(b))\n", 5, ["unknown op 'foo'"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_rejected_with_line_and_hint(case):
    _, text, line, words = case
    with pytest.raises(CuIRSyntaxError) as ei:
        parse(HEAD + text, source="bad.cuir")
    err = ei.value
    assert err.line == line, str(err)
    assert err.source == "bad.cuir"
    full = str(err)
    assert full.startswith(f"bad.cuir:{line}: ")
    for w in words:
        assert w in full, (w, full)


def test_unknown_op_lists_every_allowed_op():
    with pytest.raises(CuIRSyntaxError) as ei:
        parse("y = foo(x)\n")
    assert all(op in ei.value.hint for op in N.OPS)


def test_syntax_error_in_reference_program_names_file_and_line(tmp_path):
    text = (ref_kernel_dir("fa2_sm80") / "kernel.cuir").read_text()
    old = "    sm_scale = rsqrt(D)\n"
    assert old in text
    bad_line = text[: text.index(old)].count("\n") + 1
    path = tmp_path / "k.cuir"
    path.write_text(text.replace(old, "    sm_scale = D.rsqrt()\n"))
    with pytest.raises(CuIRSyntaxError) as ei:
        parse_file(path)
    assert ei.value.line == bad_line
    assert str(path) in str(ei.value)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(CuIRSyntaxError) as ei:
        parse_file(tmp_path / "nope.cuir")
    assert "nope.cuir" in str(ei.value)
