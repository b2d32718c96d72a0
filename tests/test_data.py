"""spmd.data: DTensorDataset and create_dtensor_iterable (TF's input_util behaviour, reference §1.9)."""

import collections
import doctest
import gc
import pathlib
import re
import threading

import numpy as np
import pytest
import torch

import spmd
from spmd import UNSHARDED, DTensorDataset, Layout, create_dtensor_iterable, create_mesh

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "data.md"


def cpus(n):
    return [f"CPU:{i}" for i in range(n)]


MESH = create_mesh([("batch", 4), ("m", 2)], devices=cpus(8))


def components(t):
    return [c.tolist() for c in spmd.unpack(t)]


class Recording(torch.utils.data.Dataset):
    """A map-style dataset of `n` rows `[i, i + 0.5, -i]` that logs each index read."""

    def __init__(self, n=64, width=3):
        self.n, self.width, self.reads = n, width, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads.append(i)
        return torch.arange(self.width, dtype=torch.float32) * 0.5 + i


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_tf_probe_component_order():
    layout = Layout.batch_sharded(MESH, "batch", rank=1)
    ds = DTensorDataset(range(64), mesh=MESH, layouts=layout, global_batch_size=16, batch_dim="batch")
    batches = list(ds)
    assert len(batches) == len(ds) == 4
    assert components(batches[0]) == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7],
                                      [8, 9, 10, 11], [8, 9, 10, 11], [12, 13, 14, 15], [12, 13, 14, 15]]
    assert components(batches[1])[0] == [16, 17, 18, 19]
    assert spmd.fetch_layout(batches[0]) == layout and batches[0].shape == (16,)


# (mesh dims, sharding specs of the batch, example shape, global batch, batch_dim)
CASES = [
    ([("batch", 4), ("m", 2)], ["batch"], (), 16, "batch"),
    ([("batch", 4), ("m", 2)], ["batch", "m"], (6,), 8, "batch"),
    ([("batch", 4), ("m", 2)], ["batch", UNSHARDED, "m"], (3, 4), 4, "batch"),
    ([("batch", 4), ("m", 2)], [UNSHARDED, "m"], (4,), 6, None),
    ([("batch", 4), ("m", 2)], ["m", "batch"], (4,), 6, None),  # batch axis over the other mesh dim
    ([("x", 2), ("y", 2)], [UNSHARDED, UNSHARDED], (5,), 3, None),
    ([("x", 8)], ["x", UNSHARDED], (2,), 8, "x"),
]


@pytest.mark.parametrize("dims,specs,shape,G,batch_dim", CASES)
def test_values_equal_plain_batching(dims, specs, shape, G, batch_dim):
    mesh = create_mesh(dims, devices=cpus(8 if len(dims) == 1 or dims[0][1] == 4 else 4))
    n = 5 * G + G // 2 + 1  # a remainder to drop
    rows = torch.arange(n * int(np.prod(shape)), dtype=torch.float64).reshape(n, *shape)
    layout = Layout(specs, mesh)
    ds = DTensorDataset(rows, mesh=mesh, layouts=layout, global_batch_size=G, batch_dim=batch_dim)
    assert ds.element_spec == spmd.data.TensorSpec(torch.Size((G, *shape)), torch.float64, layout)
    batches = list(ds)
    assert len(batches) == len(ds) == n // G
    for k, batch in enumerate(batches):
        assert spmd.fetch_layout(batch) == layout and batch.dtype == torch.float64
        torch.testing.assert_close(spmd.to_global(batch), rows[k * G:(k + 1) * G], rtol=0, atol=0)
        expected = spmd.copy_to_mesh(rows[k * G:(k + 1) * G], layout)
        assert components(batch) == components(expected)


def test_tuples_dicts_and_nesting():
    rows = [{"x": torch.full((2,), float(i)), "y": (i, torch.tensor([i, 2 * i]))} for i in range(20)]
    layouts = {"y": [Layout(["batch"], MESH), Layout(["batch", "m"], MESH)],
               "x": Layout(["batch", UNSHARDED], MESH)}
    ds = DTensorDataset(rows, mesh=MESH, layouts=layouts, global_batch_size=8, batch_dim="batch")
    spec = ds.element_spec
    assert list(spec) == ["x", "y"] and spec["y"][1].shape == (8, 2) and spec["x"].dtype == torch.float32
    batches = list(ds)
    assert len(batches) == 2
    b = batches[1]
    assert isinstance(b, dict) and list(b) == ["x", "y"] and isinstance(b["y"], tuple)
    assert spmd.to_global(b["y"][0]).tolist() == list(range(8, 16))
    assert spmd.to_global(b["y"][1]).tolist() == [[i, 2 * i] for i in range(8, 16)]
    assert spmd.to_global(b["x"]).tolist() == [[float(i)] * 2 for i in range(8, 16)]
    assert spmd.fetch_layout(b["y"][1]).sharding_specs == ["batch", "m"]
    assert components(b["y"][1])[:2] == [[[8], [9]], [[16], [18]]]

    pairs = torch.utils.data.TensorDataset(torch.arange(12.).reshape(6, 2), torch.arange(6))
    Point = collections.namedtuple("Point", "a b")
    ds = DTensorDataset([Point(*p) for p in pairs], mesh=MESH, layouts=(Layout(["batch", UNSHARDED], MESH),
                                                                       Layout(["batch"], MESH)),
                        global_batch_size=4, batch_dim="batch")
    (b,) = list(ds)
    assert isinstance(b, Point) and spmd.to_global(b.b).tolist() == [0, 1, 2, 3]


def test_map_style_reads_each_needed_row_once():
    data = Recording()
    layouts = Layout(["batch", "m"], create_mesh([("batch", 4), ("m", 3)], devices=cpus(12)))
    ds = DTensorDataset(data, mesh=layouts.mesh, layouts=layouts, global_batch_size=16, batch_dim="batch")
    data.reads.clear()
    for epoch in range(2):
        assert len(list(ds)) == 4
        # every device of a batch shard (3 replicas each) shares one read; the remainder is never read
        assert data.reads[epoch * 64:] == list(range(64))
    assert len(data.reads) == 128


@pytest.mark.parametrize("local_ids,rows", [([2, 3], [4, 5, 6, 7]), ([1, 6], [0, 1, 2, 3, 12, 13, 14, 15]),
                                            ([0, 1, 2, 3, 4, 5, 6, 7], list(range(16)))])
def test_client_reads_only_the_rows_of_its_local_devices(local_ids, rows):
    mesh = spmd.Mesh(["batch", "m"], np.arange(8).reshape(4, 2), local_ids, [f"CPU:{i}" for i in local_ids])
    data = Recording(40, width=2)
    ds = DTensorDataset(data, mesh=mesh, layouts=Layout(["batch", "m"], mesh), global_batch_size=16,
                        batch_dim="batch")
    data.reads.clear()
    batches = list(ds)
    assert len(batches) == 2
    assert data.reads == rows + [16 + r for r in rows]
    full = Recording(40, width=2)
    for loc, got in zip(mesh.local_device_locations(), spmd.unpack(batches[1])):
        b, m = loc["batch"], loc["m"]
        expected = torch.stack([full[16 + 4 * b + i] for i in range(4)])[:, m * 1:(m + 1) * 1]
        assert got.tolist() == expected.tolist()


def test_replicated_tensor_needs_every_row():
    mesh = spmd.Mesh(["batch", "m"], np.arange(8).reshape(4, 2), [2, 3], ["CPU:2", "CPU:3"])
    data = [(torch.tensor(i), torch.tensor(-i)) for i in range(8)]
    reads = []
    logged = type("Logged", (), {"__len__": lambda s: 8,
                                 "__getitem__": lambda s, i: reads.append(i) or data[i]})()
    ds = DTensorDataset(logged, mesh=mesh, layouts=(Layout(["batch"], mesh), Layout([UNSHARDED], mesh)),
                        global_batch_size=8)
    reads.clear()
    (a, b), = list(ds)
    assert reads == list(range(8))
    assert components(a) == [[2, 3], [2, 3]] and components(b) == [[-i for i in range(8)]] * 2


@pytest.mark.parametrize("source", [Stream(50), lambda: (i for i in range(50)), range(50)],
                         ids=["IterableDataset", "generator", "range"])
def test_iterables_and_epochs(source):
    one_shot = callable(source)
    ds = DTensorDataset(source() if one_shot else source, mesh=MESH, layouts=Layout(["batch"], MESH),
                        global_batch_size=8, batch_dim="batch")
    for epoch in range(1 if one_shot else 3):
        got = [spmd.to_global(b).tolist() for b in ds]
        assert got == [list(range(k * 8, k * 8 + 8)) for k in range(6)]
    if one_shot:
        assert list(ds) == []  # a generator is spent after one epoch
    if isinstance(source, range):
        assert len(ds) == 6


def test_iterable_without_length():
    ds = DTensorDataset(Stream(8), mesh=MESH, layouts=Layout(["batch"], MESH), global_batch_size=4)
    with pytest.raises(TypeError, match="the dataset \\(Stream\\) has no length"):
        len(ds)
    ds = DTensorDataset((i for i in range(8)), mesh=MESH, layouts=Layout(["batch"], MESH), global_batch_size=4)
    with pytest.raises(TypeError, match="the dataset \\(a one-shot iterator\\) has no length"):
        len(ds)


def test_a_shuffled_loader_gives_the_epochs_plain_iteration_gives():
    """Reading the first element (to learn the shapes) must not start an epoch of its own: a DataLoader draws
    a new shuffle order per iteration."""
    def loader():
        torch.manual_seed(0)
        return torch.utils.data.DataLoader(torch.arange(32.), batch_size=8, shuffle=True, drop_last=True)
    plain = loader()
    want = [[b.tolist() for b in plain] for _ in range(2)]
    ds = DTensorDataset(loader(), mesh=MESH, layouts=Layout(["batch"], MESH), global_batch_size=8,
                        batch_dim="batch", dataset_already_batched=True)
    assert [[spmd.to_global(b).tolist() for b in ds] for _ in range(2)] == want


@pytest.mark.parametrize("batched", [False, True])
def test_batch_axis_split_over_two_mesh_dims(batched):
    rows = torch.arange(64.).reshape(32, 2)
    data = list(rows.split(2)) if batched else rows  # per-replica batches of 16 // 8 rows, or rows
    ds = DTensorDataset(data, mesh=MESH, layouts=Layout([("batch", "m"), UNSHARDED], MESH), global_batch_size=16,
                        batch_dim=("batch", "m"), dataset_already_batched=batched)
    batches = list(ds)
    assert [spmd.to_global(b).tolist() for b in batches] == [rows[:16].tolist(), rows[16:].tolist()]
    assert components(batches[0]) == [rows[2 * i:2 * i + 2].tolist() for i in range(8)]


@pytest.mark.parametrize("batch_size,G", [(16, 16), (4, 16)], ids=["global batches", "per-replica batches"])
def test_dataloader_already_batched(batch_size, G):
    x, y = torch.arange(160.).reshape(80, 2), torch.arange(80)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    layouts = [Layout(["batch", "m"], MESH), Layout(["batch"], MESH)]
    ds = DTensorDataset(loader, mesh=MESH, layouts=layouts, global_batch_size=G, batch_dim="batch",
                        dataset_already_batched=True)
    assert ds.element_spec[0].shape == (G, 2)
    assert len(ds) == 80 // G
    for epoch in range(2):
        batches = list(ds)
        assert len(batches) == 5
        for k, (bx, by) in enumerate(batches):
            assert spmd.to_global(bx).tolist() == x[k * G:(k + 1) * G].tolist()
            assert spmd.to_global(by).tolist() == y[k * G:(k + 1) * G].tolist()


def test_map_style_per_replica_batches_read_once():
    """An already batched map-style dataset: each replica's batch is one element, read only when needed."""
    reads = []

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 9

        def __getitem__(self, i):
            reads.append(i)
            return torch.arange(2 * i, 2 * i + 2)

    mesh = spmd.Mesh(["batch", "m"], np.arange(8).reshape(4, 2), [4, 5], ["CPU:4", "CPU:5"])
    ds = DTensorDataset(Batches(), mesh=mesh, layouts=Layout(["batch"], mesh), global_batch_size=8,
                        batch_dim="batch", dataset_already_batched=True)
    reads.clear()
    batches = list(ds)
    assert reads == [2, 6] and len(batches) == 2
    assert components(batches[1]) == [[12, 13], [12, 13]]


def test_prefetch():
    ds = DTensorDataset(Recording(100, 2), mesh=MESH, layouts=Layout(["batch", "m"], MESH), global_batch_size=8,
                        batch_dim="batch", prefetch=2)
    plain = DTensorDataset(Recording(100, 2), mesh=MESH, layouts=Layout(["batch", "m"], MESH), global_batch_size=8,
                           batch_dim="batch")
    for epoch in range(2):
        got = [spmd.to_global(b) for b in ds]
        assert len(got) == 12
        assert all(torch.equal(a, spmd.to_global(b)) for a, b in zip(got, plain))

    # stopping early ends the background thread
    it = iter(ds)
    next(it)
    it.close()
    assert not it._thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)

    # so does dropping the iterator, e.g. after `break`
    before = set(threading.enumerate())
    for batch in ds:
        (thread,) = set(threading.enumerate()) - before
        break
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_prefetch_propagates_errors():
    class Failing(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if i == 21:
                raise KeyError("broken row 21")
            return torch.tensor(i)

    ds = DTensorDataset(Failing(), mesh=MESH, layouts=Layout(["batch"], MESH), global_batch_size=8, prefetch=3)
    it = iter(ds)
    assert spmd.to_global(next(it)).tolist() == list(range(8))
    next(it)
    with pytest.raises(KeyError, match="broken row 21"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert not it._thread.is_alive()


def test_create_dtensor_iterable():
    # the RFC: elements already batched (here 2 rows), num_elements_per_batch of them make a global batch
    rows = torch.arange(48.).reshape(24, 2)
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    it = create_dtensor_iterable(loader, element_layouts=Layout(["batch", UNSHARDED], MESH),
                                 batch_dimension="batch", num_elements_per_batch=4)
    assert isinstance(it, DTensorDataset) and it.global_batch_size == 8 and len(it) == 3
    batches = list(it)
    assert [spmd.to_global(b).tolist() for b in batches] == [rows[k * 8:k * 8 + 8].tolist() for k in range(3)]
    assert components(batches[0])[2] == [[4.0, 5.0], [6.0, 7.0]]  # shard 1 is dataset element 1

    # more elements than shards: each shard concatenates two elements
    it = create_dtensor_iterable(list(rows.split(1)), Layout(["batch", UNSHARDED], MESH), "batch", 8)
    assert [spmd.to_global(b).tolist() for b in it] == [rows[k * 8:k * 8 + 8].tolist() for k in range(3)]

    # unbatched examples are stacked
    it = create_dtensor_iterable(range(10), Layout(["batch"], MESH), "batch", 4)
    assert [spmd.to_global(b).tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    with pytest.raises(ValueError, match="num_elements_per_batch"):
        create_dtensor_iterable(range(10), Layout(["batch"], MESH), "batch", 0)
    with pytest.raises(ValueError, match="not divisible"):
        create_dtensor_iterable(range(10), Layout(["batch"], MESH), "batch", 6)


def _loader(n, batch_size, **kwargs):
    return torch.utils.data.DataLoader(torch.arange(n), batch_size=batch_size, **kwargs)


def _error_cases():
    b1 = Layout(["batch"], MESH)
    b2 = Layout(["batch", UNSHARDED], MESH)
    other = create_mesh([("batch", 4), ("m", 2)], devices=cpus(8), mesh_name="other")
    return [
        ("rank", dict(dataset=range(8), layouts=b2, global_batch_size=8),
         ValueError, r"Expected layout with rank 1 for element spec TensorSpec\(shape=\(\), dtype=torch.int64\), "
                     r"got layout .*Check that the dataset is not batched before passing to DTensorDataset"),
        ("rank batched", dict(dataset=_loader(16, 8, drop_last=True), layouts=b2, global_batch_size=16,
                              dataset_already_batched=True),
         ValueError, r"Expected layout with rank 1 .*shape=\(8,\)"),
        ("batch_dim not first", dict(dataset=[torch.zeros(4)] * 8, layouts=Layout([UNSHARDED, "batch"], MESH),
                                     global_batch_size=4, batch_dim="batch"),
         ValueError, r"batch_dim batch was specified but at least one layout did not contain it"),
        ("batch_dim other dim", dict(dataset=range(8), layouts=Layout(["m"], MESH), global_batch_size=4,
                                     batch_dim="batch"),
         ValueError, r"batch_dim batch was specified"),
        ("batch_dim unknown", dict(dataset=range(8), layouts=b1, global_batch_size=4, batch_dim="data"),
         ValueError, r"batch_dim 'data' is not a dimension of the mesh"),
        ("indivisible batch", dict(dataset=range(64), layouts=b1, global_batch_size=10, batch_dim="batch"),
         ValueError, r"global_batch_size 10 is not divisible by the 4 shards of batch_dim 'batch'"),
        ("indivisible batch no batch_dim", dict(dataset=range(64), layouts=b1, global_batch_size=6),
         spmd.IndivisibleError, r"global shape \[6\].*does not divide by the 4 shards"),
        ("indivisible axis", dict(dataset=[torch.zeros(5)] * 8, layouts=Layout(["batch", "m"], MESH),
                                  global_batch_size=4, batch_dim="batch"),
         spmd.IndivisibleError, r"global shape \[4, 5\].*axis 1 .*size 5.*2 shards of mesh dimension 'm'"),
        ("structure tuple vs tensor", dict(dataset=[(0, 1)] * 8, layouts=b1, global_batch_size=4),
         ValueError, r"structure of layouts \* does not match the structure of the dataset elements \(\*, \*\)"),
        ("structure length", dict(dataset=[(0, 1)] * 8, layouts=(b1,), global_batch_size=4),
         ValueError, r"structure of layouts \(\*,\) does not match .* \(\*, \*\)"),
        ("structure keys", dict(dataset=[{"a": 0, "b": 1}] * 8, layouts={"a": b1, "c": b1}, global_batch_size=4),
         ValueError, r"\{'a': \*, 'c': \*\} does not match .* \{'a': \*, 'b': \*\}"),
        ("not a layout", dict(dataset=[(0, 1)] * 8, layouts=(b1, "batch"), global_batch_size=4),
         TypeError, r"layouts\[1\] must be a spmd.Layout"),
        ("other mesh", dict(dataset=range(8), layouts=Layout(["batch"], other), global_batch_size=4),
         ValueError, r"is on mesh .*other.*not on the DTensorDataset's mesh"),
        ("per replica size", dict(dataset=_loader(64, 16), layouts=b1, global_batch_size=32, batch_dim="batch",
                                  dataset_already_batched=True),
         ValueError, r"per_replica_batch_size does not matched expected size based on the mesh, got 16 but "
                     r"expected 8"),
        ("drop_last", dict(dataset=_loader(60, 16), layouts=b1, global_batch_size=16, batch_dim="batch",
                           dataset_already_batched=True),
         ValueError, r"last batch has 12 rows.*drop_last=True"),
        ("batch size", dict(dataset=range(8), layouts=b1, global_batch_size=0), ValueError,
         r"global_batch_size must be a positive integer"),
        ("empty", dict(dataset=[], layouts=b1, global_batch_size=4), ValueError, r"empty dataset"),
        ("prefetch", dict(dataset=range(8), layouts=b1, global_batch_size=4, prefetch=-1), ValueError,
         r"prefetch must be"),
        ("dict dataset", dict(dataset={"a": 1}, layouts=b1, global_batch_size=4), TypeError,
         r"dataset must be a map-style dataset"),
    ]


@pytest.mark.parametrize("name,kwargs,error,message", _error_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_errors(name, kwargs, error, message):
    dataset = kwargs.pop("dataset")
    with pytest.raises(error, match=message):
        DTensorDataset(dataset, mesh=MESH, **kwargs)


def test_errors_found_while_iterating():
    b1 = Layout(["batch"], MESH)
    # an already batched iterable whose later batch has the wrong size
    batches = [torch.arange(8), torch.arange(8), torch.arange(5)]
    ds = DTensorDataset(iter(batches), mesh=MESH, layouts=b1, global_batch_size=8, dataset_already_batched=True)
    it = iter(ds)
    next(it)
    next(it)
    with pytest.raises(ValueError, match=r"batch of the wrong size: element has shape \(5,\).*8 rows"):
        next(it)
    # examples whose shapes disagree
    ds = DTensorDataset([torch.zeros(2)] * 3 + [torch.zeros(3)], mesh=MESH, layouts=Layout(["batch", UNSHARDED],
                                                                                           MESH),
                        global_batch_size=4)
    with pytest.raises(ValueError, match=r"element 3 of the dataset cannot be batched with the first: element has "
                                         r"shape \(3,\) and dtype torch.float32, the first had shape \(2,\)"):
        list(ds)
    ds = DTensorDataset([1, 2, 3.5, 4], mesh=MESH, layouts=b1, global_batch_size=4)
    with pytest.raises(ValueError, match=r"dtype torch.float32, the first had shape \(\) and dtype torch.int64"):
        list(ds)
    # a later element with another structure
    ds = DTensorDataset([(0, 1), (0, 1), 2, (0, 1)], mesh=MESH, layouts=(b1, b1), global_batch_size=4)
    with pytest.raises(ValueError, match=r"element 2 of the dataset has structure \*, but the first had"):
        list(ds)


def test_docs_examples():
    text = DOC.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)
    assert len(blocks) >= 3
    for block in blocks:
        assert block.lstrip().startswith(">>>"), block
    failed, attempted = doctest.testfile(str(DOC), module_relative=False, globs={},
                                         optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted >= 10 and failed == 0
