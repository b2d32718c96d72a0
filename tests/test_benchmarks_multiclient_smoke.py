"""Keeps benchmarks/bench_multiclient.py, bench_fsdp.py, bench_moe.py and bench_custom_ops.py from rotting: their
main() runs end to end with `--quick` (2 real client processes, gloo, a hard timeout). No timing is asserted; only
that every case runs, the values of every relayout agree across spmd, raw torch.distributed and torch DT, spmd's
training losses equal DDP's, sharded parameters hold half the state of replicated ones with the same losses, experts
under `local_map` gather no tokens, and a custom op with a sharding rule moves nothing."""

import pytest
import torch

from benchmarks import bench_custom_ops, bench_fsdp, bench_moe, bench_multiclient


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_bench_multiclient_quick(tmp_path):
    data = bench_multiclient.main(["--quick", "--timeout", "60", "--out", str(tmp_path)])
    assert (tmp_path / "multiclient.md").exists() and (tmp_path / "multiclient.json").exists()
    for n, r in data["relayout"].items():
        assert all(r["ok"].values()), (n, r["ok"])
        for name, res in r["results"].items():
            assert "error" not in res, (n, name, res)
    (mlp,) = data["mlp"]  # (one size with --quick)
    for name, res in mlp["results"].items():
        assert "error" not in res, (name, res)
    for opt in ("sgd", "adamw"):
        for variant in ("spmd", "fn", "ws"):
            assert mlp["max_loss_diff_vs_ddp"][f"{variant}/{opt}"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_bench_fsdp_quick(tmp_path):
    data = bench_fsdp.main(["--quick", "--timeout", "60", "--out", str(tmp_path)])
    assert (tmp_path / "fsdp.md").exists()
    results = data["worlds"]["2"]
    assert set(results) == set(bench_fsdp.VARIANTS)
    # spmd's initialisation is layout-invariant: sharded and replicated parameters start from the same values
    assert results["spmd_fsdp"]["first_loss"] == pytest.approx(results["spmd_dp"]["first_loss"], rel=1e-6)
    assert results["spmd_fsdp"]["state_mb"] == pytest.approx(results["spmd_dp"]["state_mb"] / 2, rel=0.05)
    assert results["spmd_fsdp"]["state_mb"] == pytest.approx(results["fsdp2"]["state_mb"], rel=0.05)
    # micro-batches under no_sync: the gradients end sharded all the same
    assert results["spmd_fsdp_accum"]["state_mb"] == pytest.approx(results["spmd_fsdp"]["state_mb"], rel=0.01)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_bench_moe_quick(tmp_path):
    pytest.importorskip("transformers")
    data = bench_moe.main(["--quick", "--timeout", "90", "--out", str(tmp_path)])
    assert set(data["results"]) == set(bench_moe.VARIANTS)
    assert all("error" not in r for r in data["results"].values()), data["results"]
    for name in bench_moe.VARIANTS:
        assert data["max_loss_diff_vs_ddp"][name] == pytest.approx(0.0, abs=1e-5)
    assert data["collectives"]["spmd"].get("all_gather", 0) > 0  # the global routing gathers the tokens
    assert "all_gather" not in data["collectives"]["spmd_local"]
    # expert parallel: 2 layers x (there, back) x (forward, backward), and half the experts' weights per client
    assert data["collectives"]["spmd_ep"] == {"all_reduce": 3, "all_to_all": 8}
    assert data["parameters_per_client"]["spmd_ep"] < data["parameters_per_client"]["ddp"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_bench_custom_ops_quick(tmp_path):
    data = bench_custom_ops.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "custom_ops.md").exists()
    assert set(data["results"]) == set(bench_custom_ops._ROWS)
    assert all("error" not in r for r in data["results"].values()), data["results"]
    # a declared rule moves nothing; the replicated fallback gathers the activation
    for where in ("8", "2"):
        assert list(data["moved"]["rule" + where]) == list(data["moved"]["local_map" + where]) == [0, 0]
        assert data["moved"]["fallback" + where][0] == 1
