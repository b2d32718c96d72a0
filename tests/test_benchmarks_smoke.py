"""Keeps benchmarks/ from rotting: each script's main() runs end to end with a handful of iterations.

No timing is asserted; only that every case runs and the MLP variants train to the same loss as plain torch.
"""

import importlib.util

import pytest

from benchmarks import bench_gpu, bench_mlp, bench_ops


def test_bench_ops_quick(tmp_path):
    data = bench_ops.main(["--quick", "--iters", "3", "--reps", "1", "--shapes", "2", "--no-profile",
                           "--out", str(tmp_path)])
    assert (tmp_path / "ops.md").exists() and (tmp_path / "ops.json").exists()
    for section in ("ops", "relayout"):
        for name, cols in data[section].items():
            for col, res in cols.items():
                expected_error = col == "dt" and "DT raises" in name  # (what the row shows of torch DTensor)
                assert ("error" in res) == expected_error, (section, name, col, res)
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


def test_bench_demo_quick(tmp_path):
    from benchmarks import bench_demo
    data = bench_demo.main(["--quick", "--steps", "1", "--reps", "1", "--warm", "1", "--no-rss",
                            "--out", str(tmp_path)])
    assert (tmp_path / "demo.md").exists() and (tmp_path / "demo.json").exists()
    assert not data["errors"], data["errors"]
    variants = data["variants"]
    assert set(variants) == set(bench_demo.VARIANTS)
    for name, r in variants.items():
        assert r["median_ms"] > 0 and r["memory"]["parameters"] > 0, name
        assert r.get("max_rel_loss_diff", 0.0) <= 1e-5, name
    # spmd on batch=4 x model=2: each device holds less than the whole model, and gradients are all-reduced
    assert variants["spmd8"]["memory"]["parameters"] < variants["plain"]["memory"]["parameters"]
    assert any(c["kind"] == "all_reduce" and c["mesh_dims"] == "batch" for c in variants["spmd8"]["collectives"])


def test_bench_jax_mlp_quick(tmp_path):
    """Runs with or without jax: without it the script skips its JAX columns itself (CI has no jax)."""
    from benchmarks import bench_jax_mlp
    data = bench_jax_mlp.main(["--quick", "--steps", "1", "--reps", "1", "--warm", "1", "--out", str(tmp_path)])
    assert (tmp_path / "jax_mlp.md").exists()
    assert not data["errors"], data["errors"]
    results = data["results"]
    assert results["torch.compile/1dev"]["max_rel_loss_diff"] <= 1e-5
    for cfg in bench_jax_mlp.CONFIGS:
        for variant in ("spmd", "spmd.function", "whole step"):
            assert results[f"{variant}/{cfg}"]["max_rel_loss_diff"] <= 1e-5, (variant, cfg)
    if data["jax"] is None:
        assert data["jax_skipped"] and not any(k.startswith("jax/") for k in results)
    else:
        assert all(f"jax/{cfg}" in results for cfg in bench_jax_mlp.CONFIGS)


def test_bench_optim_quick(tmp_path, monkeypatch):
    from benchmarks import bench_optim
    monkeypatch.setattr(bench_optim, "PARAM_SETS", {"tiny": [(16, 8), (8,)]})
    data = bench_optim.main(["--quick", "--iters", "1", "--reps", "1", "--out", str(tmp_path)])
    assert (tmp_path / "optim.md").exists()
    assert [r["optimizer"] for r in data["rows"]] == list(bench_optim.OPTIMIZERS)
    for row in data["rows"]:
        assert not row["errors"] and {"plain", "spmd1", "spmd8", "dt"} <= set(row), row


@pytest.mark.skipif(importlib.util.find_spec("monarch") is None, reason="torchmonarch is not installed")
def test_bench_controller_quick(tmp_path):
    from benchmarks import bench_controller
    data = bench_controller.main(["--quick", "--engines", "monarch", "--out", str(tmp_path)])
    assert (tmp_path / "controller.md").exists()
    r = data["engines"]["monarch"]
    assert r["step_ms"] > 0 and r["function_step_ms"] > 0 and data["multiclient_function_step_ms"] > 0


def test_bench_gpu_quick(tmp_path):
    """The GPU benchmark's eager variants on the CPU (fp32, a tiny GPT), each in a process of its own."""
    variants = ("plain", "spmd1", "spmd8", "dt")
    data = bench_gpu.main(["--quick", "--variants", ",".join(variants), "--out", str(tmp_path)])
    assert (tmp_path / "gpu.md").exists() and (tmp_path / "gpu.json").exists()
    assert data["complete"] and set(data["variants"]) == set(variants)
    for name, r in data["variants"].items():
        assert "error" not in r, (name, r["error"], r.get("traceback_tail"))
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0, name
        assert len(r["losses"]) == data["warm"] + data["steps"], name
        if name != "plain":  # fp32: the same losses and the same parameter updates as plain torch
            assert r["max_rel_loss_diff"] <= 1e-5 and r["min_update_cosine"] > 0.99, (name, r)
    assert "spmd eager, 8 virtual devices" in bench_gpu.readme_table(data)


def test_bench_gpu_reports_a_failing_or_hanging_variant(tmp_path):
    """A variant that raises or runs past its timeout comes back as an error with its log's end, not an exception,
    also when variants start together (--concurrent-compile) and one of them fails before it is let go; one that
    the budget leaves no time for is not let go at all."""
    cfg = dict(bench_gpu.QUICK, device="cpu", dtype="float32", warm=1, steps=1, threads=1, batch_size=6,
               scratch=str(tmp_path))  # a batch of 6 does not divide over the 8-device mesh's batch=4
    results, names = {}, ["spmd8", "spmd1", "plain"]
    bench_gpu.run_gated(names, cfg, dict.fromkeys(names, 120), lambda name: None if name == "plain" else 60,
                        str(tmp_path), results.__setitem__)
    assert "IndivisibleError" in results["spmd8"]["error"] and results["spmd8"]["traceback_tail"]
    assert (tmp_path / "spmd8.log").exists()
    assert "error" not in results["spmd1"] and results["spmd1"]["median_ms"] > 0
    assert "plain" not in results
    hung = bench_gpu.run_variant("plain", cfg, timeout=0.5, logs=None)
    assert hung["error"].startswith("timed out after")

