"""Imports go one way (STYLE.md): a small AST walk fails on an upward or sideways import."""

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
    "trainer": BASE,
    "weight_sync": BASE,
    "report": BASE,  # reads run directories; knows no component
    "placement": {"config"},  # which GPUs each pool uses: a pure function of the config, asked by the launchers
    # the simulator drives the real admission, batching and staleness rules (rollout, transport, trainer)
    "sim": BASE | {"rollout", "transport", "trainer"},
}


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
                found.add("launch")
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
                problems.append(f"{rel} imports async_rl.{imp}" if imp != "launch" else f"{rel} imports launch")
    assert not problems, "upward imports:\n" + "\n".join(problems)
