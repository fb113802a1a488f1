#!/usr/bin/env bash
# The small wheels the lent GPU machine lacks (Python 3.12, no package index), into .whl/ (git-ignored):
# the versions this project's .venv holds, so both machines run the same code. There:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD; python3 benchmarks/gpu_check.py --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
for name in pyzmq omegaconf fastapi starlette pydantic pydantic_core annotated-types \
            typing-inspection uvicorn isal gguf msgpack openai jiter sniffio tensordict megatron-core \
            pyvers opentelemetry-api typing_extensions httpx2 httpcore2 truststore; do
  if ! v=$(version "$name" 2>/dev/null); then echo "skip $name (not in $PY's environment)"; continue; fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$name==$v" \
    || echo "warning: no py3.12 wheel of $name==$v"
done
du -sh .whl
