"""The docs name only what exists: every path, dotted config key (and its value, where the field is a
choice), `async-rl` subcommand and results file that README.md or docs/*.md names, and every figure a
README table row shows beside the results file it cites.

Each check is a function of the text, so the tests at the end break a real README on purpose (a figure
edited, a path renamed, a key misspelt, a command invented) and see the check report it.
"""

from __future__ import annotations

import dataclasses
import io
import re
import typing
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from async_rl.config import Config
from async_rl.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("async_rl", "launch", "configs", "benchmarks", "tests", "docs")
PATH = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:%s)/[\w./*{},\-]*)" % "|".join(TOP))
LINK = re.compile(r"\]\(([^)#\s]+)")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # NAME, RUN_DIR, COMMIT: a pattern, not a file
FILE_EXTS = {"safetensors", "json", "jsonl", "yaml", "md", "py", "png", "gguf", "txt", "html", "log", "pid"}
SECTIONS = [name for name, hint in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(hint)]
KEY = re.compile(r"(?<![\w./-])((?:%s)\.[a-z_][a-z0-9_]*)(?![\w(*])(?:=([\w.\-]+))?" % "|".join(SECTIONS))
COMMAND = re.compile(r"\basync-rl\s+([a-z]+)")
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?=%))")
CITED = re.compile(r"benchmarks/results/[\w./\-]+\.md")


def _expand(pattern: str) -> list[str]:
    """`a.{md,json}` -> `a.md`, `a.json` (one brace group is all the docs use)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")]


def missing_paths(text: str, doc_dir: Path = ROOT) -> list[str]:
    """Repository paths (and relative links) the text names that do not exist; a glob must match."""
    names = {m.group(1).rstrip(".,:;") for m in PATH.finditer(text)}
    links = {(doc_dir / m.group(1)).resolve() for m in LINK.finditer(text) if "://" not in m.group(1)}
    missing = []
    for name in sorted(names):
        name = name.split("::")[0]
        if PLACEHOLDER.search(name.replace("README", "").replace("HISTORY", "")):
            continue
        for one in _expand(name):
            if not (list(ROOT.glob(one)) if "*" in one else (ROOT / one).exists()):
                missing.append(one)
    return missing + [str(p.relative_to(ROOT)) for p in sorted(links) if not p.exists()]


def _hint(dotted: str) -> object | None:
    """The type of config key `dotted` (`trainer.lr` -> float), or None where Config has no such key."""
    hint: object = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hints = typing.get_type_hints(hint)
        if part not in hints:
            return None
        hint = hints[part]
    return hint


def unknown_keys(text: str) -> list[str]:
    """Dotted config keys that async_rl.config does not have, and values outside a choice field's choices."""
    bad = []
    for m in KEY.finditer(text):
        key, value = m.group(1), m.group(2)
        if key.rsplit(".", 1)[1] in FILE_EXTS:  # model.safetensors: a file, not a key
            continue
        hint = _hint(key)
        if hint is None:
            bad.append(key)
        elif value and typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            bad.append(f"{key}={value}")
    return bad


def subcommands() -> set[str]:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return set(re.search(r"\{([a-z,]+)\}", out.getvalue()).group(1).split(","))


def unknown_commands(text: str, commands: set[str]) -> list[str]:
    return sorted({m.group(1) for m in COMMAND.finditer(text)} - commands)


def _numbers(text: str) -> set[float]:
    return {float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)}


def figure_mismatches(text: str) -> list[str]:
    """For each table row that cites a results file: figures of the row (outside its `code`) absent from it."""
    bad = []
    for row in (line for line in text.splitlines() if line.startswith("|")):
        cited = CITED.findall(row)
        if not cited:
            continue
        known = set().union(*(_numbers((ROOT / c).read_text()) for c in cited if (ROOT / c).is_file()))
        prose = re.sub(r"`[^`]*`", "", row)
        bad += [f"{n} (row citing {cited[0]})" for n in NUMBER.findall(prose) if float(n) not in known]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_path_exists(doc):
    assert missing_paths(doc.read_text(), doc.parent) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_config_key_exists(doc):
    assert unknown_keys(doc.read_text()) == []


def test_every_named_command_exists():
    commands = subcommands()
    assert {"run", "train", "rollout", "serve", "report", "audit", "keys", "sim"} <= commands
    for doc in DOCS:
        assert unknown_commands(doc.read_text(), commands) == [], doc.name


def test_every_readme_figure_is_in_the_results_file_it_cites():
    text = (ROOT / "README.md").read_text()
    assert len([r for r in text.splitlines() if r.startswith("|") and CITED.search(r)]) >= 6
    assert figure_mismatches(text) == []


# The checks above must be able to fail: break a real README on purpose and see each one report it.

def test_an_edited_figure_is_caught():
    text = (ROOT / "README.md").read_text()
    assert "1.85x (1.81-1.86)" in text
    assert figure_mismatches(text.replace("1.85x (1.81-1.86)", "1.95x (1.81-1.86)")) == [
        "1.95 (row citing benchmarks/results/async_vs_sync_frozen.md)"]


def test_a_renamed_path_a_misspelt_key_and_an_invented_command_are_caught():
    text = (ROOT / "README.md").read_text()
    assert "configs/gpu_single.yaml" in text and "`trainer.batch_size`" in text
    assert "configs/gpu_one.yaml" in missing_paths(text.replace("configs/gpu_single.yaml", "configs/gpu_one.yaml"))
    assert "benchmarks/results/weight_sync2.md" in missing_paths(
        text.replace("benchmarks/results/weight_sync.md", "benchmarks/results/weight_sync2.md"))
    assert "docs/gone.md" in missing_paths(text.replace("(docs/cpu.md)", "(docs/gone.md)"))
    assert unknown_keys(text.replace("`trainer.batch_size`", "`trainer.batchsize`")) == ["trainer.batchsize"]
    assert unknown_keys("`engine.backend=vllmx` `weight_sync.transport=zmq`") == ["engine.backend=vllmx"]
    assert unknown_commands(text + "\nasync-rl deploy --config C\n", subcommands()) == ["deploy"]
