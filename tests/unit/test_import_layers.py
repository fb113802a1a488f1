"""Imports go one way (docs/architecture.md): a small AST walk fails on an upward or sideways import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = {"types", "config", "protocols", "models", "utils"}
ALLOWED = {
    "types": set(), "config": set(), "protocols": {"types"}, "models": {"config", "utils"}, "utils": set(),
    "rewards": {"types"},
    "tasks": {"types", "config", "rewards"},
    "transport": BASE,
    "tool_parsers": set(),  # model text -> tool calls: the OpenAI server and the agent loops both parse
    "engine": BASE | {"weight_sync", "tool_parsers"},  # the engine loads what a weight transport delivers
    "agent": BASE | {"rewards", "tool_parsers"},
    "rollout": BASE | {"agent", "transport", "engine", "rewards", "tasks", "weight_sync"},
    # the step loop (trainer/loop.py) binds the queue and publishes through a weight transport, as the
    # rollout controller connects to the queue and loads through one
    "trainer": BASE | {"transport", "weight_sync"},
    "weight_sync": BASE,
    "report": BASE,  # reads run directories; knows no component
    "placement": {"config"},  # which GPUs each pool uses: a pure function of the config, asked by the launchers
    # the simulator drives the real admission, batching and staleness rules (rollout, transport, trainer)
    "sim": BASE | {"rollout", "transport", "trainer"},
}
# the processes, launchers and command line: the top, the only layer that knows every concrete class
ALLOWED["launch"] = set(ALLOWED)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "launch":
                found.add("<top-level launch>")
            elif parts[0] == "async_rl" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_layers():
    problems = []
    for path in sorted((ROOT / "async_rl").rglob("*.py")):
        rel = path.relative_to(ROOT / "async_rl")
        layer = rel.parts[0].removesuffix(".py")
        if layer == "__init__":
            continue
        allowed = ALLOWED.get(layer)
        assert allowed is not None, f"{rel}: new top-level module {layer!r}: add it to ALLOWED with its layer"
        for imp in _imports(path) - {layer}:
            if imp not in allowed:
                problems.append(f"{rel} imports async_rl.{imp}" if imp[0] != "<" else f"{rel} imports {imp}")
    assert not problems, "upward imports:\n" + "\n".join(problems)


def _module_graph() -> dict[str, set[str]]:
    """async_rl module -> the async_rl modules it imports, anywhere in the file (function-level too)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "async_rl").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def test_no_import_circles():
    """A module that serves several sits below them; the one that wires them imports them, never
    the other way round. A circle hidden in a function-level import counts too."""
    graph, circles, state = _module_graph(), [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_one_top_level_package():
    """The distribution installs `async_rl` alone: the top-level launch/ folder holds entry scripts run as
    files (no __init__.py, not in pyproject's package list), and nothing imports a module called `launch`."""
    import tomllib

    from setuptools import find_packages

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    tops = {name.split(".")[0] for name in find_packages(str(ROOT), include=project["include"])}
    assert tops == {"async_rl"}, f"pyproject.toml installs top-level packages {sorted(tops)}"
    assert not (ROOT / "launch" / "__init__.py").exists(), "launch/ is a folder of scripts, not a package"
    importers = [str(path.relative_to(ROOT)) for top in ("async_rl", "launch", "tests", "benchmarks")
                 for path in sorted((ROOT / top).rglob("*.py")) if "<top-level launch>" in _imports(path)]
    assert not importers, "import the package (async_rl.launch), not a top-level `launch`: " + ", ".join(importers)
