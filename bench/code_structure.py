"""Structure counts of the package, read from its source with `ast` (nothing is imported).

    python bench/code_structure.py [src/grpo]

Prints, one per line:
- files over 400 lines and functions over 60 lines;
- function-local imports of grpo modules (an import inside a def, often hiding a cycle or a layer break);
- import cycles: strongly connected groups of grpo modules, counting every import (module-level and function-local);
- choice sets defined more than once: the same set of string values written as an Enum's members and/or an
  UPPER_CASE tuple/list/set of strings in two places.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


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


def main(root: Path) -> None:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = defaultdict(set)
    local_imports, sets, long_files, long_functions = [], defaultdict(list), [], []
    for name, path in files.items():
        text = path.read_text()
        tree = ast.parse(text)
        graph[name] |= {m for node in ast.walk(tree) for m in imported_modules(node, modules, name) if m != name}
        local_imports += [(name, line, m) for line, m in function_local_imports(tree, modules, name)]
        for set_name, values in choice_sets(tree):
            sets[values].append(f"{name}.{set_name}")
        if text.count("\n") > 400:
            long_files.append(f"{name} ({text.count(chr(10))})")
        long_functions += [f"{name}.{f.name} ({f.end_lineno - f.lineno + 1})" for f in ast.walk(tree)
                           if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > 60]
    twice = {values: where for values, where in sets.items() if len(where) > 1}
    found_cycles = cycles(graph)
    print(f"files over 400 lines: {len(long_files)}  {', '.join(long_files)}")
    print(f"functions over 60 lines: {len(long_functions)}  {', '.join(long_functions)}")
    print(f"function-local imports of grpo modules: {len(local_imports)}")
    for name, line, m in local_imports:
        print(f"    {name}:{line} -> {m}")
    print(f"import cycles: {len(found_cycles)}")
    for c in found_cycles:
        print(f"    {' <-> '.join(c)}")
    print(f"choice sets defined more than once: {len(twice)}")
    for values, where in twice.items():
        print(f"    {sorted(values)}: {', '.join(where)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src" / "grpo"))
