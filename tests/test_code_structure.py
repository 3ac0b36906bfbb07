"""The package's structure held to ceilings: `bench/code_structure.py --check`, which .ci/run runs on src/grpo beside
lint-imports, fails when files over 500 lines, functions over 60, function-local imports of the package or import
cycles grow past their ceilings, and when a count falls below its ceiling (lower it then, so it stays down)."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import code_structure  # noqa: E402


def _package(root):
    """A package with one of each: a 501-line file, a 61-line function, a function-local import, a cycle."""
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import pkg.b\n\n\ndef uses_b():\n    from pkg import c\n    return c\n")
    (pkg / "b.py").write_text("from pkg import a\n" + "\n" * 500)
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    (pkg / "c.py").write_text(f"def long():\n{body}    return 0\n")
    return pkg


def test_each_kind_is_counted_with_where_it_is(tmp_path):
    found = code_structure.measure(_package(tmp_path), file_lines=500)
    assert found.long_files == ["pkg.b (501)"]
    assert found.long_functions == ["pkg.c.long (61)"]
    assert found.local_imports == ["pkg.a:5 -> pkg.c"]
    assert found.cycles == [["pkg.a", "pkg.b"]]


def test_a_count_over_its_ceiling_fails_and_one_below_asks_to_lower_it(tmp_path, monkeypatch):
    pkg = _package(tmp_path)
    problems = code_structure.check(pkg)
    over = [p for p in problems if "over its ceiling" in p]
    # The fake package has one of each kind: over the ceilings that are 0.
    kinds = ["files_over_500_lines", "functions_over_60_lines", "function_local_imports", "import_cycles"]
    assert [p.split(":")[0] for p in over] == [k for k in kinds if code_structure.CEILINGS[k] < 1]
    assert "pkg.a <-> pkg.b" in over[-1]
    # A ceiling above the count (every real one may be 0): the check asks for it to be lowered.
    monkeypatch.setitem(code_structure.CEILINGS, "files_over_500_lines", 2)
    problems = code_structure.check(pkg)
    assert "files_over_500_lines: 1, below its ceiling 2: lower CEILINGS['files_over_500_lines']" in problems[0]

