"""Relayout from every layout to every other one: the value is unchanged, each component is the right slice of
the global tensor, gradients flow back with the input's layout."""

from __future__ import annotations

import itertools

import pytest
import torch

import spmd
from spmd import MATCH, UNSHARDED, Layout
from sweep import MESH, all_layouts, check_replicas, distribute, gather, rand

MESH3 = spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])


def expected_components(x: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The component of each local device: the block `layout.offset_to_shard()` names, per axis."""
    mesh = layout.mesh
    offsets = layout.offset_to_shard()
    out = []
    for device in mesh.local_device_ids():
        block = x
        for axis, (shard, n) in enumerate(zip(offsets[device - mesh.min_global_device_id()],
                                              layout.num_shards_per_axis())):
            size = x.shape[axis] // n
            block = block.narrow(axis, shard * size, size)
        out.append(block)
    return out


def check_components(t, x: torch.Tensor) -> None:
    layout = spmd.fetch_layout(t)
    got = spmd.unpack(t)
    want = expected_components(x, layout)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"component {i} of layout {layout.sharding_specs}"


def sweep_relayout(mesh, shape, grad: bool, multi: bool = False) -> int:
    x = rand(*shape)
    weights = rand(*shape, seed=5)
    layouts = all_layouts(mesh, shape, multi)
    for src, dst in itertools.product(layouts, layouts):
        leaf = distribute(x, src).detach().requires_grad_(grad)
        out = spmd.relayout(leaf, dst)
        assert spmd.fetch_layout(out) == dst, (src.sharding_specs, dst.sharding_specs)
        check_replicas(out)
        check_components(out, x)
        assert torch.equal(gather(out), x), (src.sharding_specs, dst.sharding_specs)
        if grad:
            (out * distribute(weights, dst)).sum().backward()
            assert spmd.fetch_layout(leaf.grad) == src, (src.sharding_specs, dst.sharding_specs)
            check_replicas(leaf.grad)
            assert torch.equal(gather(leaf.grad), weights), (src.sharding_specs, dst.sharding_specs)
    return len(layouts) ** 2


@pytest.mark.parametrize("shape", [(4, 4), (4, 2, 4)], ids=["rank2", "rank3"])
def test_every_pair_2x2(shape):
    assert sweep_relayout(MESH, shape, grad=True) == len(all_layouts(MESH, shape)) ** 2


def test_every_pair_2x2x2_rank2():
    assert sweep_relayout(MESH3, (4, 4), grad=True) == 13 ** 2


def test_every_pair_2x2x2_rank3():
    assert sweep_relayout(MESH3, (4, 4, 4), grad=True) == 34 ** 2


def test_every_pair_2x2x2_rank3_values():
    assert sweep_relayout(MESH3, (2, 4, 2), grad=False) == len(all_layouts(MESH3, (2, 4, 2))) ** 2


def test_all_layouts_counts():
    assert len(all_layouts(MESH, (4, 4))) == 7
    assert len(all_layouts(MESH, (4, 3))) == 3  # axis 1 does not divide
    assert len(all_layouts(MESH, (1, 4))) == 3  # size 1: unsharded only
    assert len(all_layouts(MESH, ())) == 1
    assert len(all_layouts(MESH3, (4, 4, 4))) == 34
    assert len({l.sharding_specs.__repr__() for l in all_layouts(MESH3, (4, 4, 4))}) == 34


def test_copy_to_mesh_components():
    x = rand(4, 2, 4)
    for layout in all_layouts(MESH3, x.shape):
        t = distribute(x, layout)
        check_components(t, x)
        check_replicas(t)


@pytest.mark.parametrize("mesh", [MESH, MESH3], ids=["2x2", "2x2x2"])
def test_match_keeps_axes(mesh):
    x = rand(4, 4)
    for src in all_layouts(mesh, x.shape):
        t = distribute(x, src)
        for dst in all_layouts(mesh, x.shape):
            for keep in itertools.product([False, True], repeat=2):
                specs = [MATCH if k else s for k, s in zip(keep, dst.sharding_specs)]
                want = [src.sharding_specs[i] if k else dst.sharding_specs[i] for i, k in enumerate(keep)]
                used = [s for s in want if s != UNSHARDED]
                if len(used) != len(set(used)):
                    with pytest.raises(ValueError):
                        spmd.relayout(t, Layout(specs, mesh))
                    continue
                out = spmd.relayout(t, Layout(specs, mesh))
                assert spmd.fetch_layout(out).sharding_specs == want
                check_components(out, x)


def test_relayout_to_same_layout_is_identity():
    t = distribute(rand(4, 4), Layout(["x", "y"], MESH))
    assert spmd.relayout(t, Layout(["x", "y"], MESH)) is t


def test_chained_relayouts_gradient():
    x = rand(4, 2, 4)
    leaf = distribute(x, Layout(["x", UNSHARDED, "y"], MESH)).detach().requires_grad_()
    out = leaf
    for specs in (["y", UNSHARDED, "x"], [UNSHARDED, "x", UNSHARDED], ["x", "y", UNSHARDED]):
        out = spmd.relayout(out, Layout(specs, MESH))
    (out * 3).sum().backward()
    assert spmd.fetch_layout(leaf.grad) == spmd.fetch_layout(leaf)
    assert torch.equal(gather(leaf.grad), torch.full_like(x, 3))


@pytest.mark.parametrize("shape,specs,axis,size,dim,shards", [
    ((3, 4), ["x", UNSHARDED], 0, 3, "x", 2),
    ((4, 6), [UNSHARDED, "y"], None, None, None, None),  # divisible: no error
    ((4, 5), ["x", "y"], 1, 5, "y", 2),
])
def test_indivisible(shape, specs, axis, size, dim, shards):
    x = rand(*shape)
    t = distribute(x, Layout.replicated(MESH, 2))
    if axis is None:
        assert torch.equal(gather(spmd.relayout(t, Layout(specs, MESH))), x)
        return
    for attempt in (lambda: spmd.relayout(t, Layout(specs, MESH)), lambda: distribute(x, Layout(specs, MESH))):
        with pytest.raises(spmd.IndivisibleError) as info:
            attempt()
        assert isinstance(info.value, ValueError)
        message = str(info.value)
        assert f"axis {axis}" in message and f"size {size}" in message and repr(dim) in message
        assert f"{shards} shards" in message


def test_indivisible_on_3d_mesh():
    t = distribute(rand(2, 3), Layout.replicated(MESH3, 2))
    with pytest.raises(spmd.IndivisibleError, match=r"axis 1 .*size 3.*'c'"):
        spmd.relayout(t, Layout([UNSHARDED, "c"], MESH3))
