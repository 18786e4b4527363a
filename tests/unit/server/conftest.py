"""Fixtures of the server's unit tests."""

from __future__ import annotations

import pytest

from server.datasets import DatasetBundle, load_dataset


@pytest.fixture(scope="module")
def digits() -> DatasetBundle:
    """The digits data set, loaded once per test file (read only: tests build orchestrators on it)."""
    return load_dataset("digits", seed=0)
