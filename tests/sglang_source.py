"""SGLang 0.5.23's own code on a CPU machine, for tests that hold this project's requests to it.

`make install` installs the wheel without its dependencies (`pip install --no-deps
sglang==0.5.23`) plus the `sglang-contract` extra (msgspec, pybase64, aiohttp, ipython). The
package's `__init__` imports the GPU stack (triton, through `srt/utils/common.py`), so the
modules are loaded with it skipped: `sglang` and `sglang.srt.utils` become bare packages over
the installed directories, and the modules below import as they are.

- `sglang.api.v1.api_types` and `sglang.srt.entrypoints.api_contract`: the JSON schema every
  `/generate` body passes since 0.5.22 (`generate_contract_error`), imported as they are.
- `sglang/srt/managers/io_struct.py` does not import here (triton again, via schedule_batch), so
  `io_struct_models` builds the request classes the HTTP routes take from that file's own class
  definitions (`BaseReq` and each class asked for, as written there) with msgspec and SGLang's own
  `msgspec_struct_pydantic_core_schema`, and `validate` checks a body as FastAPI does for
  `Annotated[X, Body()]` in `srt/entrypoints/http_server.py`.

Every function returns None (and tests skip, saying why) where sglang is not installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pydantic

VERSION = "0.5.23"
SKIP = f"sglang {VERSION} is not installed (make install: pip install --no-deps sglang=={VERSION} and '.[sglang-contract]')"


def source_dir() -> Path | None:
    """The installed package's directory, found without importing it."""
    if "sglang" in sys.modules:
        return Path(list(sys.modules["sglang"].__path__)[0])
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _bare(name: str, path: Path) -> None:
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg


def load(module: str) -> Any:
    """An sglang module, imported without the package __init__s that pull in the GPU stack."""
    root = source_dir()
    if root is None:
        return None
    _bare("sglang", root)
    _bare("sglang.srt.utils", root / "srt" / "utils")
    return importlib.import_module(module)


def generate_contract_error(body: dict[str, Any]) -> str | None:
    """SGLang's own verdict on a /generate body (api_contract.generate_contract_error): None if it passes."""
    return load("sglang.srt.entrypoints.api_contract").generate_contract_error(body)


def io_struct_models(*names: str) -> dict[str, type]:
    """The request classes `names` of srt/managers/io_struct.py, built from that file's definitions."""
    root = source_dir()
    tree = ast.parse((root / "srt" / "managers" / "io_struct.py").read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    aliases = {t.id: n for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    module = types.ModuleType("sglang_io_struct_from_source")  # annotations resolve in its namespace
    module.__dict__.update({k: getattr(typing, k) for k in typing.__all__})
    module.__dict__["msgspec"] = importlib.import_module("msgspec")
    module.__dict__["msgspec_struct_pydantic_core_schema"] = load(
        "sglang.srt.utils.msgspec_utils").msgspec_struct_pydantic_core_schema
    module.__dict__["WeightVersionSpans"] = load("sglang.srt.utils.weight_versions").WeightVersionSpans
    sys.modules[module.__name__] = module
    wanted = ["BaseReq", *names]
    body = [aliases["FinishReasonDict"]] + [defs[n] for n in wanted]
    exec(compile(ast.Module(body=body, type_ignores=[]), str(root / "srt/managers/io_struct.py"), "exec"),
         module.__dict__)
    return {n: module.__dict__[n] for n in names}


def validate(model: type, body: dict[str, Any]) -> Any:
    """`body` checked as SGLang's HTTP route checks it (pydantic over the msgspec struct); ValidationError if not."""
    return pydantic.TypeAdapter(model).validate_python(body)


def ignored_keys(model: type, body: dict[str, Any]) -> set[str]:
    """Keys of `body` the model does not declare: SGLang accepts and ignores them (extra_behavior="ignore")."""
    fields = {f.name for f in importlib.import_module("msgspec").structs.fields(model)}
    return set(body) - fields


def function(relpath: str, name: str, namespace: dict[str, Any] | None = None) -> Any:
    """The top-level function `name` of the installed file `sglang/<relpath>`, run from that file's own
    text where its module does not import here (e.g. `srt/utils/common.py` imports triton at the top):
    its definition alone is compiled against `namespace` (the module globals it reads). None without sglang."""
    root = source_dir()
    if root is None:
        return None
    path = root / relpath
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope: dict[str, Any] = dict(namespace or {})
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), scope)
    return scope[name]
