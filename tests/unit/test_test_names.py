"""The suite's own layout: pytest imports test modules by basename (rootdir-relative "prepend"
import mode), so two test files with the same name in different folders stop the whole run at
collection ("import file mismatch"). This fails first, naming them."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_module_has_its_own_basename():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}
