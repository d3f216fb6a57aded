"""The benchmark scripts import each other downward only: no module of benchmarks/ reaches itself
through the others' imports, function-level imports included (mfu_megatrain and mfu_moe once
imported each other, each half-built while the other ran)."""

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def sibling_imports() -> dict[str, set[str]]:
    modules = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def test_no_benchmark_module_imports_itself_through_others():
    graph = sibling_imports()
    circles = []

    def visit(name: str, path: list[str]) -> None:
        for other in sorted(graph[name]):
            if other == path[0]:
                circles.append(" -> ".join([*path, other]))
            elif other not in path and other > path[0]:  # each circle once, from its smallest module
                visit(other, [*path, other])

    for start in sorted(graph):
        visit(start, [start])
    assert graph["mfu"] and not circles, circles
