"""Bad input raises a clear, typed error in the user's terms, at once: meshes, layouts and their strings.

(Bad arguments to torch ops are in test_torch_errors.py.)
"""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import MATCH, UNSHARDED as U, Layout, Mesh
from spmd.errors import LayoutError

MATCH_USES = {
    "zeros": lambda l: spmd.zeros((4,), layout=l),
    "ones": lambda l: spmd.ones((4,), layout=l),
    "fill": lambda l: spmd.fill((4,), 1.0, layout=l),
    "pack": lambda l: spmd.pack([torch.zeros(1)] * 4, l),
    "copy_to_mesh": lambda l: spmd.copy_to_mesh(torch.zeros(4), l),
    "call_with_layout": lambda l: spmd.call_with_layout(torch.zeros, l, (4,)),
    "DVariable": lambda l: spmd.DVariable(torch.zeros(4), layout=l),
}


@pytest.mark.parametrize("use", list(MATCH_USES))
def test_match_only_serves_relayout(mesh22, use):
    with pytest.raises(LayoutError, match="MATCH only serves relayout"):
        MATCH_USES[use](Layout([MATCH], mesh22))


def test_match_in_relayout_still_keeps_the_axis(mesh22):
    t = spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x", U], mesh22))
    assert spmd.fetch_layout(spmd.relayout(t, Layout([MATCH, "y"], mesh22))).sharding_specs == ["x", "y"]


@pytest.mark.parametrize("name", ["unsharded", "match", "a,b", "a|b", "a=b", ""])
def test_mesh_dimension_names_that_layouts_cannot_tell_apart_are_refused(name):
    with pytest.raises(LayoutError, match=f"mesh dimension name {name!r} is not allowed"):
        spmd.create_mesh([(name, 2)])


def test_strings_must_be_strings():
    with pytest.raises(TypeError, match="Mesh.from_string expects a str, got NoneType"):
        Mesh.from_string(None)
    with pytest.raises(TypeError, match="Layout.from_string expects a str, got int"):
        Layout.from_string(3)


def test_negative_mesh_sizes_in_a_string():
    devices = ",".join(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2))
    with pytest.raises(LayoutError, match=r"sizes must be positive, got \[-2\]"):
        Mesh.from_string(f"|x=-2|0,1|0,1|{devices}")


def test_a_mesh_too_large_for_one_process_is_refused_at_once():
    with pytest.raises(LayoutError, match="10,000,000,000 devices"):
        spmd.create_mesh([("x", 10 ** 10)])


@pytest.mark.parametrize("flags, says", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--n-head", "5"], "--d-model 64 must divide into --n-head 5 heads"),
    (["--mesh", "batch=3"], "mesh dimension batch=3 (--mesh 'batch=3') must divide --batch-size (32)"),
    (["--mesh", "model=5"], "mesh dimension model=5 (--mesh 'model=5') must divide --n-head (4)"),
    (["--mesh", "foo"], "--mesh must look like 'batch=4,model=2', got 'foo'"),
    (["--mesh", "batch=2,batch=2"], "needs distinct dimension names"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
])
def test_demo_flags_are_checked_before_training(flags, says):
    from spmd.cli import main
    with pytest.raises(SystemExit) as info:
        main(["demo", *flags])
    message = str(info.value.code)  # one line, no traceback
    assert message.startswith("spmd demo: error: ") and says in message and "\n" not in message
