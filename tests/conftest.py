"""Shared test set-up: `@pytest.mark.gpu` tests are skipped where no CUDA device is present."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
