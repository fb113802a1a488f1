"""Weight versions: they only go forward, and each one is a directory of its own.

    check_newer(version, engine.weight_version, field="weight_version", current_is="the version in use")
    stage = StagedVersion(root, layout, reuse=oldest_stale)   # root/.v000012.partial/model.safetensors
    ...; path = stage.finish()                                # -> root/v000012 (a whole version or none)
    prune(root, 12, keep_last=2)                              # whole directories of v000010 and older

A version that is not newer than the one a side already holds (or accepted, or published)
is refused with `WeightVersionError`, whose message names the field, both versions and
what the older one is; a publisher that sends the same version again (for a side that
joined) passes `replay_ok`.

On disk, version N is the directory `vNNNNNN` holding `model.safetensors`, because that is
what SGLang loads: `/update_weights_from_disk` takes a checkpoint *directory* (a local one
only if `os.path.isdir(model_path)`, `sglang/srt/model_loader/loader.py`,
`DefaultModelLoader._prepare_weights`; a file path is looked up on the Hugging Face hub)
and loads every `*.safetensors` in it, so two versions must never share one. The update
reuses the model config the server started with (`model_runner_components/weight_updater.py`,
`update_weights_from_disk`), so no config.json is needed beside the weights.
`version_of` is the one rule for "this path is a weight version".
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from async_rl.weight_sync.layout import WeightLayout
from async_rl.weight_sync.staging import StagedFile, WeightVersionError

WEIGHTS_FILE = "model.safetensors"  # the one weights file of a version directory
_NAME = re.compile(r"^(\.?)v(\d{6,})(\.partial)?$")


def check_newer(version: int, current: int, *, field: str, current_is: str, replay_ok: bool = False) -> None:
    """Raise WeightVersionError unless `version` is newer than `current` (or the same, with `replay_ok`)."""
    if version > current or (replay_ok and version == current):
        return
    relation = "older than" if replay_ok else "not newer than"
    raise WeightVersionError(f"{field}: {version} is {relation} {current_is} ({current}); "
                             "a version going backwards is refused")


# --------------------------------------------------------------------------- naming
def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def version_of(path: str | Path, *, partial: bool = False) -> int | None:
    """The version a directory named `vNNNNNN` holds (with `partial`, also one being written,
    `.vNNNNNN.partial`); None for any other path."""
    m = _NAME.match(Path(path).name)
    if m is None or bool(m.group(1)) != bool(m.group(3)) or (m.group(3) and not partial):
        return None
    return int(m.group(2))


# --------------------------------------------------------------------------- lifecycle
def check_keep_last(keep_last: int) -> int:
    if keep_last < 1:
        raise ValueError(f"weight_sync.keep_last: must be >= 1, got {keep_last}")
    return keep_last


def stale_dirs(root: Path, version: int, keep_last: int) -> list[Path]:
    """Version directories more than `keep_last` versions older than `version`, oldest first."""
    found = [(v, d) for d in root.iterdir() if (v := version_of(d)) is not None]
    return [d for v, d in sorted(found) if v <= version - keep_last]


def prune(root: Path, version: int, keep_last: int) -> None:
    """Remove the directories of versions more than `keep_last` older than `version`."""
    for d in stale_dirs(root, version, keep_last):
        shutil.rmtree(d, ignore_errors=True)


def superseded(path: str | Path, version: int) -> bool:
    """Whether the weights of `version` (its directory, `path`) are gone because a newer version replaced
    them. They go only for a newer version: pruned once that one is complete, or taken over while it is
    written, so a newer directory, whole or partial, is beside them. Weights gone with nothing newer
    beside them (a directory this process does not see, a wrong path) are not superseded, they are missing."""
    p = Path(path)
    if (p / WEIGHTS_FILE).exists() or not p.parent.is_dir():
        return False
    return any((v := version_of(d, partial=True)) is not None and v > version for d in p.parent.iterdir())


class StagedVersion(StagedFile):
    """A version assembled in `root/.vNNNNNN.partial/` and renamed to `root/vNNNNNN` by `finish`, so a
    reader finds a whole version directory or none. A version published again (a trainer resumed from a
    checkpoint, the current weights sent again to a side that joined) keeps its directory: the new file is
    written beside the old one (`.model.safetensors.partial`, which SGLang's `*.safetensors` glob skips)
    and renamed over it, so a server loading that version meanwhile reads the old file or the new one,
    never a missing directory. `reuse` (a stale version directory) lends its weights file when nobody
    reads it (`StagedFile`); that directory then goes at once."""

    def __init__(self, root: str | Path, layout: WeightLayout, reuse: Path | None = None):
        self.final = version_dir(root, layout.version)
        self.partial_dir: Path | None = None
        home = self.final
        if not self.final.is_dir():
            self.partial_dir = home = self.final.with_name(f".{self.final.name}.partial")
            shutil.rmtree(self.partial_dir, ignore_errors=True)  # what a crashed attempt left
            self.partial_dir.mkdir(parents=True)
        super().__init__(home / WEIGHTS_FILE, layout, reuse=None if reuse is None else reuse / WEIGHTS_FILE)
        if self.reused:
            shutil.rmtree(reuse, ignore_errors=True)

    def finish(self) -> Path:
        super().finish()
        if self.partial_dir is not None:
            os.replace(self.partial_dir, self.final)
        return self.final

    def abandon(self) -> None:
        super().abandon()
        if self.partial_dir is not None:
            shutil.rmtree(self.partial_dir, ignore_errors=True)
