import random


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/cpu/golden/ from the current code generators")
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run test files in a seeded random order, each file's tests forwards or reversed "
                          "(surfaces order dependence; .ci/run uses it for its second pass)")


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    # Whole files move and a file's tests are only reversed, never interleaved: module-scoped
    # fixtures (a Ray instance, a tuned run) stay set up once, so the pass costs what a plain one does.
    rng = random.Random(seed)
    files: dict = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    order = list(files)
    rng.shuffle(order)
    items[:] = [it for f in order for it in (files[f][::-1] if rng.random() < 0.5 else files[f])]


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"shuffled order: --shuffle {seed}"
