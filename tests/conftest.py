"""Shared test set-up: `@pytest.mark.gpu` tests are skipped where no CUDA device is present;
`@pytest.mark.first` files are collected first; `--no-staleness-gate` runs the end-to-end staleness checks with the gate off (they must fail)."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--no-staleness-gate", action="store_true",
                     help="disable the rollout side's staleness gate in the runs of the end-to-end staleness "
                          "checks (tests/e2e/admission.py), to see them fail without it")


def pytest_configure(config):
    if config.getoption("--no-staleness-gate"):
        from tests.e2e.admission import GATE_OFF

        GATE_OFF["on"] = True


def pytest_collection_modifyitems(config, items):
    # longest first: with `-n 2 --dist loadfile` a worker that picks the longest file last ends the run alone
    items.sort(key=lambda item: item.get_closest_marker("first") is None)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
