"""`spmd demo` and `spmd tour`, in small configurations (the full demo runs in CI as the README's first command)."""

import io
import warnings

import pytest
from rich.console import Console

from spmd import cli
from spmd.demo.train import DemoArgs, parse_mesh, run


def _quiet():
    return Console(file=io.StringIO(), width=120)


@pytest.mark.parametrize("mesh,dropout", [("batch=4,model=2", 0.0), ("batch=2", 0.1), ("model=2", 0.0)])
def test_demo_loss_curve_matches_single_device(mesh, dropout):
    result = run(DemoArgs(mesh=mesh, steps=3, batch_size=8, block_size=16, d_model=32, dropout=dropout),
                 _quiet())
    assert result["parity"], result
    assert len(result["losses"]) == 3 and result["tokens_per_s"] > 0


@pytest.mark.parametrize("shard_parameters,dropout", [(False, 0.0), (True, 0.0), (False, 0.1)])
def test_demo_compiled_matches_single_device(shard_parameters, dropout):
    """(With dropout, the compiled step draws its seeds inside the graph; the check is a 1-device mesh's run.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(DemoArgs(mesh="batch=2,model=2", steps=3, batch_size=8, block_size=16, d_model=32,
                              compile=True, shard_parameters=shard_parameters, dropout=dropout), _quiet())
    assert not [w for w in caught if "graph breaks" in str(w.message)]  # beyond torch's own (backward, step)
    assert result["parity"], result


@pytest.mark.parametrize("mesh,shard_parameters,dropout", [("batch=2,model=2", False, 0.0),
                                                           ("batch=2,model=2", True, 0.0), ("batch=2", False, 0.1)])
def test_demo_as_one_graph_matches_single_device(mesh, shard_parameters, dropout):
    result = run(DemoArgs(mesh=mesh, steps=4, batch_size=8, block_size=16, d_model=32, whole_step=True,
                          shard_parameters=shard_parameters, dropout=dropout), _quiet())
    assert result["parity"], result


def test_demo_with_sharded_parameters_matches_single_device():
    result = run(DemoArgs(mesh="batch=4,model=2", steps=3, batch_size=8, block_size=16, d_model=32,
                          shard_parameters=True), _quiet())
    assert result["parity"], result


def test_parse_mesh():
    assert parse_mesh("batch=4,model=2") == [("batch", 4), ("model", 2)]
    with pytest.raises(ValueError, match="batch=4,model=2"):
        parse_mesh("batch:4")


def test_cli_entry_points(capsys):
    assert cli.main(["demo", "--steps", "2", "--batch-size", "8", "--block-size", "16", "--mesh", "batch=2"]) == 0
    assert cli.main(["tour", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "loss curves" in out and "equal" in out and "SPMD expansion" in out
