"""Keeps benchmarks/bench_multiclient.py from rotting: its main() runs end to end with `--quick` (2 real client
processes, gloo, a hard timeout). No timing is asserted; only that every case runs, the values of every relayout
agree across spmd, raw torch.distributed and torch DT, and spmd's training losses equal DDP's."""

import pytest
import torch

from benchmarks import bench_multiclient


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_bench_multiclient_quick(tmp_path):
    data = bench_multiclient.main(["--quick", "--timeout", "60", "--out", str(tmp_path)])
    assert (tmp_path / "multiclient.md").exists() and (tmp_path / "multiclient.json").exists()
    for n, r in data["relayout"].items():
        assert all(r["ok"].values()), (n, r["ok"])
        for name, res in r["results"].items():
            assert "error" not in res, (n, name, res)
    for name, res in data["mlp"]["results"].items():
        assert "error" not in res, (name, res)
    for opt in ("sgd", "adamw"):
        assert data["mlp"]["max_loss_diff_vs_ddp"][f"spmd/{opt}"] == pytest.approx(0.0, abs=1e-5)
