"""Keeps benchmarks/ from rotting: each script's main() runs end to end with a handful of iterations.

No timing is asserted; only that every case runs and the MLP variants train to the same loss as plain torch.
"""

import pytest

from benchmarks import bench_mlp, bench_ops


def test_bench_ops_quick(tmp_path):
    data = bench_ops.main(["--quick", "--iters", "3", "--reps", "1", "--shapes", "2", "--no-profile",
                           "--out", str(tmp_path)])
    assert (tmp_path / "ops.md").exists() and (tmp_path / "ops.json").exists()
    for section in ("ops", "relayout"):
        for name, cols in data[section].items():
            for col, res in cols.items():
                assert "error" not in res, (section, name, col, res)
    assert data["cache"]["spmd1 miss"]["median"] > 0


def test_bench_mlp_quick(tmp_path):
    data = bench_mlp.main(["--quick", "--steps", "1", "--reps", "1", "--warm", "2", "--configs", "8,16,1,8",
                           "--out", str(tmp_path)])
    assert (tmp_path / "mlp.md").exists()
    assert not data["errors"], data["errors"]
    for per_opt in data["results"].values():
        for runs in per_opt.values():
            for variant, r in runs.items():
                assert r.get("max_loss_diff", 0.0) == pytest.approx(0.0, abs=1e-5), variant
