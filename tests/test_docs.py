"""Runs the examples of docs/guide.md (doctest on the markdown: the `>>>` examples run in order, in one namespace)."""

import doctest
import pathlib
import re
import warnings

import pytest

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_every_python_block_is_a_checked_example():
    blocks = _python_blocks(GUIDE.read_text())
    assert len(blocks) >= 10
    for block in blocks:
        assert block.lstrip().startswith(">>>"), block  # only doctest examples, so nothing goes unchecked
        # doctest reads an example's expected output up to a blank line: without one, the closing fence would be
        # taken as output
        assert block.endswith("\n\n") or block.rstrip().splitlines()[-1].startswith((">>>", "...")), block


def test_guide_examples():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "no sharding rule" notices
        failed, attempted = doctest.testfile(str(GUIDE), module_relative=False, optionflags=FLAGS, verbose=False,
                                             report=True, raise_on_error=False, globs={})
    assert attempted >= 60
    assert failed == 0, f"{failed} of {attempted} examples of {GUIDE.name} failed (see the output above)"


def test_function_mode_guide_examples():
    """docs/function.md. Its examples run in a namespace named after an importable module that holds the modules
    they use: compiled code guards on a global module through its `__name__` (doctest's default is `__main__`)."""
    import sys
    import types

    import torch

    import spmd
    namespace = types.ModuleType("spmd_function_guide")
    namespace.torch, namespace.spmd = torch, spmd
    sys.modules[namespace.__name__] = namespace
    guide = GUIDE.parent / "function.md"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failed, attempted = doctest.testfile(str(guide), module_relative=False, optionflags=FLAGS, verbose=False,
                                             report=True, raise_on_error=False, globs=dict(vars(namespace)))
    assert attempted >= 20
    assert failed == 0, f"{failed} of {attempted} examples of {guide.name} failed (see the output above)"


def test_interop_guide_examples():
    """docs/interop.md: PyTorch/XLA, JAX, torch DTensor and HuggingFace users' examples."""
    pytest.importorskip("jax")
    guide = GUIDE.parent / "interop.md"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failed, attempted = doctest.testfile(str(guide), module_relative=False, optionflags=FLAGS, verbose=False,
                                             report=True, raise_on_error=False, globs={})
    assert attempted >= 15
    assert failed == 0, f"{failed} of {attempted} examples of {guide.name} failed (see the output above)"
