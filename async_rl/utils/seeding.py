"""Stable seeds derived from names: the same run seed and sample give the same sampling seed anywhere.

Python's `hash` is salted per process, so seeds that must agree across processes (the
rollout side of a sync run and of an async run, a restarted rollout side) come from a
cryptographic hash of their parts instead.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed determined by `parts` (e.g. run seed, sample id, index in the group)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
