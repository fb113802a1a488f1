"""Fixtures shared by integration tests: `target`, the servers the SGLang contract tests drive (sglang_targets)."""

from sglang_targets import target  # noqa: F401  (a fixture: pytest finds it here)
