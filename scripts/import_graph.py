"""The project's layers, read from its imports: circles, upward imports, and the picture in
docs/architecture.md.

    python scripts/import_graph.py            # print the picture and any violation; exit 1 on one
    python scripts/import_graph.py --write    # also rewrite the picture in docs/architecture.md

Every ``import`` and ``from ... import`` counts, at module level or inside a function, and so do
``importlib.import_module("literal")`` and the ``"module:function"`` strings of a command table
(``megatrain/cli.py``). A unit is a top-level package of the engine (``megatrain.model``) or one of
its top-level modules (``megatrain.errors``), or the orchestration package ``tasks`` or ``flows``.

The rules (tests/test_imports.py holds them on every change):
- no import circle between any two modules;
- a unit imports only units of a lower layer (never one of its own layer, never one above);
- every unit has a layer (a new package is placed in ``LAYERS`` on purpose);
- kernels import nothing of megatrain's outside kernels, and of the rest only the standard
  library, torch, triton and torchao.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatrain", "flows", "tasks")

# Bottom first. A unit may import units of lower layers only; units of one layer are independent.
LAYERS: list[tuple[str, list[str]]] = [
    ("ground", ["megatrain", "megatrain.errors", "megatrain.waits", "megatrain.kernels"]),
    ("definitions", ["megatrain.config", "megatrain.storage"]),
    ("parts", ["megatrain.model", "megatrain.optim", "megatrain.data", "megatrain.observe", "megatrain.launch"]),
    ("precision", ["megatrain.precision"]),
    ("parallelism", ["megatrain.parallel"]),
    ("state", ["megatrain.checkpoint"]),
    ("around the state", ["megatrain.reliability", "megatrain.interop"]),
    ("readers", ["megatrain.evaluate", "megatrain.report"]),
    ("training", ["megatrain.training"]),
    ("commands", ["megatrain.cli", "megatrain.train"]),
    ("Prefect tasks", ["tasks"]),
    ("Prefect flows", ["flows"]),
]
KERNEL_THIRD_PARTY = {"torch", "triton", "torchao"}
BEGIN, END = "<!-- import-graph: begin (scripts/import_graph.py --write) -->", "<!-- import-graph: end -->"


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    edges: dict[str, set[str]]  # module -> modules it imports (project modules only)
    external: dict[str, set[str]] = field(default_factory=dict)  # module -> third-party top-level names


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            names[name.removesuffix(".__init__")] = path
    return names


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    """Every dotted name this module imports (the module and, for ``from``, module.name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            module, _, function = node.value.partition(":")  # a command table's "module:function"
            if module.split(".")[0] in PACKAGES and function.isidentifier() and all(
                    p.isidentifier() for p in module.split(".")):
                found.append(module)
    return found


def build_graph(root: Path = ROOT) -> Graph:
    modules = _module_names(root)
    graph = Graph(modules, {m: set() for m in modules}, {m: set() for m in modules})
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in _imported_names(ast.parse(path.read_text(), str(path)), package):
            top = target.split(".")[0]
            if top not in PACKAGES:
                if top and top not in sys.stdlib_module_names and top != "__future__":
                    graph.external[name].add(top)
                continue
            while target and target not in modules:  # megatrain.config.Config -> megatrain.config
                target = target.rpartition(".")[0]
            # a module importing its own package (``from megatrain.config import x`` inside it) is
            # an import of a sibling by name, not of the package above
            if target and target != name and not name.startswith(target + "."):
                graph.edges[name].add(target)
    return graph


def unit_of(module: str) -> str:
    """megatrain.model.gpt -> megatrain.model; megatrain.errors -> megatrain.errors; tasks.x -> tasks."""
    parts = module.split(".")
    return parts[0] if parts[0] != "megatrain" else ".".join(parts[:2])


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph.edges):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def layer_of() -> dict[str, int]:
    return {unit: level for level, (_, units) in enumerate(LAYERS) for unit in units}


def violations(graph: Graph) -> list[str]:
    """Every broken rule, one line each (empty: the layering holds)."""
    layers = layer_of()
    problems = [f"import circle: {' <-> '.join(group)}" for group in circles(graph)]
    for unit in sorted({unit_of(m) for m in graph.modules} - set(layers)):
        problems.append(f"{unit} has no layer: place it in LAYERS (scripts/import_graph.py)")
    for module, targets in sorted(graph.edges.items()):
        source = unit_of(module)
        for target in sorted(targets):
            dest = unit_of(target)
            if source == dest or source not in layers or dest not in layers:
                continue
            if layers[dest] >= layers[source]:
                where = "the same layer" if layers[dest] == layers[source] else "a higher layer"
                problems.append(f"{module} imports {target}: {dest} is in {where} "
                                f"({LAYERS[layers[dest]][0]}) than {source} ({LAYERS[layers[source]][0]})")
        if source == "megatrain.kernels":
            for other in sorted(graph.external[module] - KERNEL_THIRD_PARTY):
                problems.append(f"{module} imports {other}: kernels use only torch, triton and torchao")
    return problems


def unit_edges(graph: Graph) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, targets in graph.edges.items():
        edges.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets)
    for unit, targets in edges.items():
        targets.discard(unit)
    return edges


def picture(graph: Graph) -> str:
    """Layers top down; each unit with the units it imports (short names: model = megatrain.model)."""
    edges = unit_edges(graph)
    short = lambda unit: unit.removeprefix("megatrain.")  # noqa: E731
    width = max(len(short(u)) for _, units in LAYERS for u in units)
    lines = []
    for level in range(len(LAYERS) - 1, -1, -1):
        name, units = LAYERS[level]
        lines.append(f"{level:>2} {name}")
        for unit in units:
            uses = ", ".join(short(t) for t in sorted(edges.get(unit, ()), key=lambda t: (-layer_of()[t], t)))
            lines.append(f"     {short(unit):<{width}}  -> {uses or '(nothing of the project)'}")
    return "\n".join(lines)


def docs_section(graph: Graph) -> str:
    return f"{BEGIN}\n```\n{picture(graph)}\n```\n{END}"


def write_docs(graph: Graph, path: Path) -> bool:
    """Replace the picture between the markers; True when the file changed."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    updated = text[:start] + docs_section(graph) + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the picture in docs/architecture.md")
    args = parser.parse_args(argv)
    graph = build_graph()
    print(picture(graph))
    if args.write and write_docs(graph, ROOT / "docs" / "architecture.md"):
        print("docs/architecture.md: picture updated")
    problems = violations(graph)
    for line in problems:
        print(f"VIOLATION: {line}", file=sys.stderr)
    print(f"{len(graph.modules)} modules, {sum(map(len, graph.edges.values()))} imports, "
          f"{len(circles(graph))} circles, {len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
