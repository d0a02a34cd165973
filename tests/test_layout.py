"""The house's layout: no import cycles among the shipped packages' modules (lazy imports inside functions count)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec_engine", "spec_kernels")


def module_files() -> dict[str, Path]:
    """{dotted module name: its file} for every module of the shipped packages."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}  # fmt: skip


def imported_names(m: str, path: Path) -> set[str]:
    """The absolute names module ``m`` (at ``path``) imports anywhere in its body, from the source text."""
    package = m if path.name == "__init__.py" else m.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.update([base] + [f"{base}.{a.name}" for a in node.names])
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports anywhere in its body}, from the source text (nothing is imported)."""
    files = module_files()
    graph = {m: set() for m in files}
    for m, path in files.items():
        for name in imported_names(m, path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != m and not m.startswith(name + "."):  # a module's own package runs first anyway
                graph[m].add(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle once, started at its smallest module."""
    cycles = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                cycles.append(path)
            elif nxt > start and nxt not in path:
                walk(start, path + [nxt])

    for m in sorted(graph):
        walk(m, [m])
    return cycles


def test_finder_sees_a_planted_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert "spec_engine.server.app" in graph and "spec_engine.llm" in graph["spec_engine.server.app"]
    assert import_cycles(graph) == []


def test_runtime_never_imports_training():
    """``spec_engine.training`` (the recipes that made the shipped models) imports the runtime, never the reverse: no
    module outside it imports it, lazily inside a function included (the CLI dispatches no training command)."""
    graph = import_graph()
    assert "spec_engine.training.train" in graph["spec_engine.training.train_eagle"]  # the walk sees the package
    training = "spec_engine.training"
    inside = {m for m in graph if m == training or m.startswith(training + ".")}
    offenders = {m: sorted(d for d in deps if d in inside) for m, deps in graph.items() if m not in inside}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_package_never_imports_bench():
    """``bench/`` is a source checkout's package, not shipped in the wheel: no module of the shipped packages imports
    it (lazily inside a function included), so nothing installed reaches for it."""
    offenders = {m: sorted(n for n in imported_names(m, path) if n == "bench" or n.startswith("bench."))
                 for m, path in module_files().items()}  # fmt: skip
    assert {m: names for m, names in offenders.items() if names} == {}
