"""Weight versions only go forward: the one check every transport, route and engine calls.

    check_newer(version, engine.weight_version, field="weight_version", current_is="the version in use")

A version that is not newer than the one a side already holds (or accepted, or published)
is refused with `WeightVersionError`, whose message names the field, both versions and
what the older one is. A publisher that sends the same version again (for a side that
joined) passes `replay_ok`.
"""

from __future__ import annotations

from async_rl.weight_sync.staging import WeightVersionError


def check_newer(version: int, current: int, *, field: str, current_is: str, replay_ok: bool = False) -> None:
    """Raise WeightVersionError unless `version` is newer than `current` (or the same, with `replay_ok`)."""
    if version > current or (replay_ok and version == current):
        return
    relation = "older than" if replay_ok else "not newer than"
    raise WeightVersionError(f"{field}: {version} is {relation} {current_is} ({current}); "
                             "a version going backwards is refused")
