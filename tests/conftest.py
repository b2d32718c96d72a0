"""Fixtures shared by the test modules."""

import pytest

import spmd


@pytest.fixture(scope="module")
def mesh22():
    """The 2x2 mesh of TF's tests: dims x and y over 4 virtual CPU devices."""
    return spmd.create_mesh([("x", 2), ("y", 2)])
