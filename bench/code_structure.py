"""Structure counts of the package, read from its source with `ast` (nothing is imported).

    python bench/code_structure.py [src/grpo]            # the counts, each with where
    python bench/code_structure.py --check [src/grpo]    # .ci/run: exit 1 when a count is not at its ceiling

Prints, one per line:
- files over 400 lines and functions over 60 lines;
- function-local imports of grpo modules (an import inside a def, often hiding a cycle or a layer break);
- import cycles: strongly connected groups of grpo modules, counting every import (module-level and function-local);
- choice sets defined more than once: the same set of string values written as an Enum's members and/or an
  UPPER_CASE tuple/list/set of strings in two places.

`--check` holds four of them to CEILINGS, today's counts (files over 500 lines with it): a count above its ceiling
fails, and so does one below it until the ceiling is lowered to match, so the numbers only go down.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# What the counts call long (the printed report's; --check counts files over CHECK_FILE_LINES).
FILE_LINES = 400
CHECK_FILE_LINES = 500
FUNCTION_LINES = 60
# The counts `--check` allows in src/grpo: each may only go down (lower it when a change brings its count down).
CEILINGS = {
    "files_over_500_lines": 0,
    "functions_over_60_lines": 0,
    "function_local_imports": 0,
    "import_cycles": 0,
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.AST, modules: set[str], here: str) -> list[str]:
    """grpo modules an Import/ImportFrom node names (`from a.b import c` is a.b.c when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative import
        base = ".".join(here.split(".")[: -node.level] + ([base] if base else []))
    out = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    if len(out) < len(node.names) and base in modules:
        out.append(base)
    return out


def function_local_imports(tree: ast.AST, modules: set[str], here: str) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                found += [(node.lineno, m) for m in imported_modules(node, modules, here)]
    return sorted(set(found))


def choice_sets(tree: ast.AST) -> list[tuple[str, frozenset[str]]]:
    """(name, values) of every Enum class with string members and every UPPER_CASE collection of >= 2 strings."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
            values = [s.value.value for s in node.body if isinstance(s, ast.Assign)
                      and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]
            if len(values) >= 2:
                out.append((node.name, frozenset(values)))
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
            elts = node.value.elts
            if names and len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
                out.append((names[0], frozenset(e.value for e in elts)))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@dataclass
class Structure:
    """What `measure` found, each entry naming where."""

    long_files: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    local_imports: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    choice_sets_twice: dict[frozenset[str], list[str]] = field(default_factory=dict)


def measure(root: Path, file_lines: int = FILE_LINES, function_lines: int = FUNCTION_LINES) -> Structure:
    """The package under `root`: files over `file_lines` lines, functions over `function_lines`, function-local
    imports of its modules, import cycles, choice sets written twice."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = defaultdict(set)
    sets: dict[frozenset[str], list[str]] = defaultdict(list)
    out = Structure()
    for name, path in files.items():
        text = path.read_text()
        tree = ast.parse(text)
        graph[name] |= {m for node in ast.walk(tree) for m in imported_modules(node, modules, name) if m != name}
        out.local_imports += [f"{name}:{line} -> {m}" for line, m in function_local_imports(tree, modules, name)]
        for set_name, values in choice_sets(tree):
            sets[values].append(f"{name}.{set_name}")
        if text.count("\n") > file_lines:
            out.long_files.append(f"{name} ({text.count(chr(10))})")
        out.long_functions += [f"{name}.{f.name} ({f.end_lineno - f.lineno + 1})" for f in ast.walk(tree)
                               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                               and f.end_lineno - f.lineno + 1 > function_lines]
    out.choice_sets_twice = {values: where for values, where in sets.items() if len(where) > 1}
    out.cycles = cycles(graph)
    return out


def check(root: Path) -> list[str]:
    """One line per count of CEILINGS that `root` exceeds, or that went below its ceiling (lower the ceiling then, so
    that the counts only go down); empty when each count is at its ceiling."""
    found = measure(root, file_lines=CHECK_FILE_LINES)
    counts = {"files_over_500_lines": found.long_files, "functions_over_60_lines": found.long_functions,
              "function_local_imports": found.local_imports, "import_cycles": [" <-> ".join(c) for c in found.cycles]}
    problems = []
    for key, where in counts.items():
        if len(where) > CEILINGS[key]:
            problems.append(f"{key}: {len(where)}, over its ceiling {CEILINGS[key]} (bench/code_structure.py, "
                            f"CEILINGS): {', '.join(where)}")
        elif len(where) < CEILINGS[key]:
            problems.append(f"{key}: {len(where)}, below its ceiling {CEILINGS[key]}: lower CEILINGS['{key}'] in "
                            f"bench/code_structure.py to {len(where)}, so that it stays there")
    return problems


def main(root: Path) -> None:
    found = measure(root)
    print(f"files over {FILE_LINES} lines: {len(found.long_files)}  {', '.join(found.long_files)}")
    print(f"functions over {FUNCTION_LINES} lines: {len(found.long_functions)}  {', '.join(found.long_functions)}")
    print(f"function-local imports of grpo modules: {len(found.local_imports)}")
    for line in found.local_imports:
        print(f"    {line}")
    print(f"import cycles: {len(found.cycles)}")
    for c in found.cycles:
        print(f"    {' <-> '.join(c)}")
    print(f"choice sets defined more than once: {len(found.choice_sets_twice)}")
    for values, where in found.choice_sets_twice.items():
        print(f"    {sorted(values)}: {', '.join(where)}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--check"]
    package = Path(args[0]) if args else Path(__file__).resolve().parents[1] / "src" / "grpo"
    if "--check" not in sys.argv:
        main(package)
    elif problems := check(package):
        print("code structure check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)
    else:
        print(f"code structure within its ceilings: {CEILINGS}")
