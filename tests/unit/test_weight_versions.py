"""The one rule every transport, route and engine calls: a weight version only goes forward."""

import pytest

from async_rl.weight_sync.staging import WeightVersionError
from async_rl.weight_sync.versions import check_newer


def test_a_version_must_be_newer_and_the_refusal_names_the_field_and_both_versions():
    check_newer(4, 3, field="weight_version", current_is="the version in use")
    for same_or_older in (3, 2):
        with pytest.raises(WeightVersionError, match=rf"^weight_version: {same_or_older} is not newer than the "
                                                     r"version in use \(3\); a version going backwards is refused$"):
            check_newer(same_or_older, 3, field="weight_version", current_is="the version in use")


def test_a_replay_of_the_same_version_passes_only_when_allowed():
    check_newer(3, 3, field="version", current_is="the last published", replay_ok=True)
    with pytest.raises(WeightVersionError, match=r"^version: 2 is older than the last published \(3\)"):
        check_newer(2, 3, field="version", current_is="the last published", replay_ok=True)
