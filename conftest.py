"""Makes the public API available to every doctest as bare names (`create_mesh`, `Layout`, ...)."""

import pytest
import torch

import spmd


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update({name: getattr(spmd, name) for name in spmd.__all__})
    doctest_namespace.update(spmd=spmd, torch=torch)
