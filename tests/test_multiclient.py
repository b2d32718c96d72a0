"""Multi-client mode: real 2-process runs on 127.0.0.1 (gloo), and the runtime's single-process behaviour.

Every subprocess runs under a hard timeout and is killed when it overruns, so a bug can fail these tests but
never hang the suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spmd
from spmd import runtime
from tests import clients

WORKER = Path(__file__).with_name("multiclient_worker.py")
HARD_TIMEOUT = 90  # seconds for a whole run (the slowest takes ~10 s)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def launch(scenario, argv_extra=(), **kwargs) -> list:
    """Runs `scenario` of multiclient_worker.py (or a script path) as clients, with `argv_extra` after it; returns
    their RESULTs."""
    argv = [scenario, *argv_extra] if str(scenario).endswith(".py") else [WORKER, scenario, *argv_extra]
    results, launch.outputs = clients.launch(argv, hard_timeout=HARD_TIMEOUT, **kwargs)
    return results


# -- real multi-client runs ------------------------------------------------------------------------------------------
def test_dtensor_docs_example():
    """TF's real 2-client probe: 2 clients x 2 CPUs, each packs its 2 components; the sum is 6.0 everywhere."""
    results = launch("docs_example")
    for c, r in enumerate(results):
        assert r["client"] == c and r["num_clients"] == 2 and r["job"] == "worker"
        assert r["local_devices"] == [f"/job:worker/replica:0/task:{c}/device:CPU:{i}" for i in range(2)]
        assert r["num_global"] == 4 and r["local_ids"] == [2 * c, 2 * c + 1]
        prefix = f"/job:worker/replica:0/task:{c}/device:CPU:"
        assert r["mesh"] == f"|x=4|0,1,2,3|{2 * c},{2 * c + 1}|{prefix}0,{prefix}1"
        assert r["shape"] == [4] and r["sum"] == 6.0
        assert r["replicated"] == [0.0, 1.0, 2.0, 3.0] and r["global"] == [0.0, 1.0, 2.0, 3.0]
        assert r["unpacked"] == [[2.0 * c], [2.0 * c + 1]]  # local components only
        assert "expected 2 components" in r["pack_error"] and "local device" in r["pack_error"]
        assert r["shutdown_error"] == "Shutting down accelerator system under multi-client mode is not supported."
        assert r["fully_local"] is False and r["torch_device"] == "cpu"


def test_collectives_match_in_process_backend():
    """Every backend method, every relayout between layouts, a sharded contraction and reductions, on meshes whose
    groups are local, split 1+1, 2+2 and unequally 2+1 between the clients, equal the one-process results."""
    results = launch("collectives")
    for r in results:
        assert r["failures"] == [] and r["checks"] > 700


def test_training_parity_with_one_process():
    """An MLP with DVariables on batch x model: 2 clients x 2 devices == 1 process x 4 devices (float64)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from multiclient_worker import _mlp_losses
    finally:
        sys.path.remove(str(WORKER.parent))
    single, layouts = _mlp_losses(spmd.create_mesh([("batch", 2), ("model", 2)]))
    for r in launch("training"):
        assert r["layouts"] == layouts
        assert r["losses"] == pytest.approx(single, rel=1e-9)
    assert single[-1] < single[0]


@pytest.mark.parametrize("per_client, dims, collectives", [
    # torchrun's case, one device per client, data parallel: the loss's mean, then one all-reduce per gradient
    (1, (2, 1), {"forward": 1, "backward": 3}),
    # two devices per client, batch x model: the model all-reduces stay inside a client (local ops)
    (2, (2, 2), {"forward": 1, "backward": 3}),
])
def test_compiled_training_parity_with_one_process(per_client, dims, collectives):
    """The MLP's step under spmd.function on 2 clients == eager on 1 process; the traced graphs hold
    torch.distributed's functional collectives (an all-reduce and its wait per cross-client reduction), and
    inductor's code one all-reduce per graph (the gradients' in one bucket)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from multiclient_worker import _mlp_losses
    finally:
        sys.path.remove(str(WORKER.parent))
    single, layouts = _mlp_losses(spmd.create_mesh([("batch", dims[0]), ("model", dims[1])]))
    for r in launch("compiled_training", argv_extra=[per_client, f"{dims[0]},{dims[1]}"]):
        assert r["layouts"] == layouts
        assert r["aot_eager"] == pytest.approx(single, rel=1e-9)
        assert r["inductor"] == pytest.approx(single, rel=1e-9)
        for graph, n in collectives.items():
            assert sorted(r["collectives"][graph]) == sorted(
                ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"] * n), graph
        # inductor merges the backward's gradient all-reduces into one bucket: one call per graph
        assert r["inductor_all_reduces"] == [1, 1]


def _worker_function(name):
    sys.path.insert(0, str(WORKER.parent))
    try:
        import multiclient_worker
    finally:
        sys.path.remove(str(WORKER.parent))
    return getattr(multiclient_worker, name)


@pytest.mark.parametrize("per_client, dims", [(1, (2, 1)), (2, (2, 2))])
def test_bucketed_gradients_match_one_process(per_client, dims):
    """distribute_module's gradient buckets: the losses and parameters of the one-process run, for bucketing off,
    one gradient per bucket and one bucket for all; one async all_reduce per bucket and nothing else in backward
    and step but the loss's; no_sync over 2 micro-batches equals one batch of both, with one bucket per step."""
    dp_training = _worker_function("_dp_training")
    mesh = spmd.create_mesh([("batch", dims[0]), ("model", dims[1])])
    single_losses, single_params, _ = dp_training(mesh)
    _, big_batch_params, _ = dp_training(mesh, micro_batches=1)
    accumulated_losses, _, _ = dp_training(mesh, micro_batches=2)
    buckets = {"0": 0, "1e-06": 6, "25": 1}  # 6 parameters, all replicated: each gradient a pending sum
    for r in launch("bucketed_training", argv_extra=[per_client, f"{dims[0]},{dims[1]}"]):
        for cap, n in buckets.items():
            losses, params, calls = r[cap]
            assert losses == pytest.approx(single_losses, rel=1e-9), cap
            for p, q in zip(params, single_params):
                assert torch.allclose(torch.tensor(p), torch.tensor(q), rtol=1e-9, atol=1e-12), cap
            for step in calls:
                assert step.count(True) == n, (cap, step)
                if n:
                    assert step.count(False) == 1, (cap, step)  # the loss's all-reduce
        losses, params, calls = r["no_sync"]
        assert losses == pytest.approx(accumulated_losses, rel=1e-9)
        for p, q in zip(params, big_batch_params):
            assert torch.allclose(torch.tensor(p), torch.tensor(q), rtol=1e-9, atol=1e-12)
        assert all(step.count(True) == 1 and step.count(False) == 2 for step in calls), calls


def test_a_bucket_sums_in_the_last_backwards_buffer_once_no_gradient_holds_it():
    """Each backward's one bucket reuses the last backward's buffer, except after the user kept step 2's gradients
    (views of it): step 3 takes new memory, step 4 reuses step 3's, and the kept gradients keep their values."""
    for r in launch("bucket_buffers"):
        first, second, third, fourth = r["buffers"]
        assert first == second and third == fourth and second != third and r["kept_unchanged"], r


def test_pending_sum_is_reduced_in_its_own_memory_unless_shared():
    """gloo all-reduces in place: a pending sum that nothing else holds is reduced where it is (no copy); one whose
    memory another tensor holds is reduced into a copy, the holder's partial sums untouched."""
    for r in launch("donated_all_reduce"):
        assert r["in_place"] and r["holder_kept"] and all(r["values"]), r
        assert r["views_in_place"] and all(r["views_values"]), r




def test_grad_scaler_skips_the_step_on_every_client_or_none():
    results = launch("grad_scaler")
    for r in results:
        for mode in ("fused", "foreach"):
            assert r[f"{mode} inf"] == [2.0, [1.0] * 4], (r["client"], mode)  # skipped everywhere, scale halved
            scale, column = r[f"{mode} finite"]
            assert scale == 2.0 and all(v < 1.0 for v in column), (r["client"], mode)
    assert results[0] == results[1] | {"client": 0}


def test_comparisons_answer_for_the_whole_tensors_on_every_client():
    results = launch("comparisons")
    for r in results:
        assert r["far"] == [False, False] and r["far cols"] == [False, False], r
        assert r["near"] == [False, True] and r["same"] == [True, True], r
    assert results[0] == results[1] | {"client": 0}


def test_ops_whose_shape_depends_on_the_values_give_every_client_the_whole_result():
    results = launch("value_shaped")
    for c, r in enumerate(results):
        assert r["selected"] == [1., 4., 5., 6.] and r["nonzero"] == [[0, 1], [1, 0], [3, 0], [3, 1]], r
        assert r["unique"] == [[False, True], [4, 4]], r
        assert r["grad"] == [[[2., 0.], [0., 8.]], [[10., 12.], [0., 0.]]][c:c + 1], r  # each client's block










def test_initialisation_from_dtensor_variables():
    """DTENSOR_JOBS / DTENSOR_CLIENT_ID instead of torchrun's variables."""
    results = launch("dtensor_env", dtensor_env=True)
    for c, r in enumerate(results):
        assert r["before"]["client"] == c and r["before"]["num_clients"] == 2 and r["before"]["job"] == "worker"
        assert r["before"]["full_job_name"] == f"worker/replica:0/task:{c}" and len(r["before"]["jobs"]) == 2
        assert r["sum"] == 3.0 and r["local_devices"] == [f"/job:worker/replica:0/task:{c}/device:CPU:0"]
        assert r["mesh"] == f"|x=2|0,1|{c}|/job:worker/replica:0/task:{c}/device:CPU:0"


def test_dataset_reads_only_local_rows():
    """Client c of a batch=2 x model=2 mesh holds batch shard c: it reads rows 4c..4c+3 of each batch of 8."""
    results = launch("dataset")
    expected_sums = [sum(3.0 * i + i % 5 for i in range(8 * b, 8 * b + 8)) for b in range(4)]
    for c, r in enumerate(results):
        own = {8 * b + 4 * c + i for b in range(4) for i in range(4)}
        assert set(r["read"]) - {0} == own - {0}  # plus row 0, read once to learn the element shapes
        assert r["sums"] == expected_sums
        assert r["components"] == [[4.0 * c + i for i in range(4)]] * 2


def test_multi_mesh_embedding():
    """An embedding table on its own mesh, activations moved to the compute mesh; both meshes span the clients."""
    for r in launch("multi_mesh"):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-12)
        assert r["table_grad"] < 1e-9 and r["proj_grad"] < 1e-9 and r["grad_layout"] == ["unsharded", "e"]


def test_to_global_and_cross_mesh_send_only_what_is_missing():
    """to_global sends each distinct shard once (nothing when every client holds them all); a relayout onto another
    mesh sends each client only the parts of its target shards it lacks (2 clients x 2 devices, 8x4 fp32)."""
    for r in launch("traffic"):
        assert all(r["ok"].values()), r["ok"]
        calls = r["calls"]
        assert calls["to_global R"] == [] and calls["to_global S_model"] == []  # every client holds every shard
        assert calls["to_global S_batch"] == [["all_gather", 16]]  # one copy of its 4x4 rows, not one per model
        assert calls["to_global S_batch_model"] == [["all_gather", 16]]  # its two 4x2 shards
        assert calls["rows to rows"] == [] and calls["replicated to columns"] == []  # each holds its target rows
        assert calls["rows to columns"] == [["all_to_all_single", 8]]  # the 4x2 block the other client lacks


def test_multiclient_guide_script(tmp_path):
    """The complete program of docs/multiclient.md, as 2 clients."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "multiclient.md").read_text()
    script = tmp_path / "train_mc.py"
    script.write_text(re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)[0])
    launch(script)
    out0, out1 = (o[0] for o in launch.outputs)
    assert [line.split()[1] for line in out0.splitlines() if line.startswith("step")] == ["0", "1", "2"]
    assert out1 == ""  # only client 0 prints


# -- the runtime in one process --------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    for k in ("DTENSOR_JOBS", "DTENSOR_CLIENT_ID", "DTENSOR_JOB_NAME", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "SPMD_COLLECTIVE_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    if runtime.is_initialized():
        runtime.shutdown_accelerator_system()


def test_config_defaults_need_no_initialisation(clean_env):
    assert spmd.client_id() == 0 and spmd.num_clients() == 1 and spmd.job_name() == "localhost"
    assert runtime.full_job_name() == "localhost/replica:0/task:0" and runtime.jobs() == []
    assert spmd.local_devices("CPU") == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    assert spmd.num_local_devices("CPU") == spmd.num_global_devices("CPU") == 1
    assert not runtime.is_initialized()
    with pytest.raises(ValueError, match="Device type XPU is not CPU, GPU, or TPU."):
        spmd.local_devices("XPU")
    with pytest.raises(ValueError, match="Unexpected task ID 1 in local runs"):
        runtime.full_job_name(1)


def test_config_errors(clean_env):
    clean_env.setenv("DTENSOR_CLIENT_ID", "-1")
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        spmd.client_id()
    clean_env.setenv("DTENSOR_JOBS", "localhost:1,localhost:2")
    clean_env.setenv("DTENSOR_CLIENT_ID", "2")
    with pytest.raises(ValueError, match="must be < 2, got 2"):
        spmd.client_id()
    clean_env.setenv("DTENSOR_CLIENT_ID", "1")
    assert spmd.client_id() == 1 and spmd.num_clients() == 2 and spmd.job_name() == "worker"
    assert spmd.num_global_devices("CPU") == 2
    clean_env.setenv("DTENSOR_JOBS", "/bns/localhost/1,/bns/localhost/0")
    with pytest.raises(ValueError, match="Unexpected DTENSOR_JOBS"):
        runtime.jobs()


def test_single_client_initialise_and_shutdown(clean_env):
    with pytest.raises(ValueError, match="Accelerators are uninitialized"):
        spmd.create_distributed_mesh([("x", 2)])
    with pytest.raises(ValueError, match="Accelerator system is not initialized"):
        spmd.shutdown_accelerator_system()
    with pytest.raises(ValueError, match="Unknown device_type XPU"):
        spmd.initialize_accelerator_system("XPU")
    assert spmd.initialize_accelerator_system("cpu", num_logical_cpu_devices=4, collective_timeout=7) == "CPU"
    with pytest.raises(ValueError, match="already been initialized"):
        spmd.initialize_accelerator_system("CPU")
    assert spmd.num_local_devices("CPU") == 4 and runtime.collective_timeout().total_seconds() == 7
    mesh = spmd.create_distributed_mesh([("x", 2), ("y", 2)], mesh_name="m")
    assert mesh.is_fully_local() and mesh.local_device_ids() == [0, 1, 2, 3]
    assert mesh.local_devices()[3] == "/job:localhost/replica:0/task:0/device:CPU:3"
    with pytest.raises(ValueError, match=r"Global number of devices \(4 per client \* 1 clients = 4\)"):
        spmd.create_distributed_mesh([("x", 8)])
    t = spmd.copy_to_mesh(torch.arange(4.0), spmd.Layout(["x"], mesh))
    assert t.sum().item() == 6.0
    spmd.barrier(mesh)
    spmd.shutdown_accelerator_system()
    assert not runtime.is_initialized()


def test_mesh_of_other_clients_without_initialisation(clean_env):
    """A mesh naming another task's devices parses, is not fully local, and its collectives explain what to do."""
    mesh = spmd.Mesh.from_string("|x=4|0,1,2,3|2,3|/job:worker/replica:0/task:1/device:CPU:0,"
                                 "/job:worker/replica:0/task:1/device:CPU:1")
    assert not mesh.is_fully_local() and mesh.torch_device == torch.device("cpu")
    t = spmd.pack([torch.ones(1), torch.ones(1)], spmd.Layout(["x"], mesh))
    with pytest.raises(ValueError, match="one per local device"):
        spmd.pack([torch.ones(1)] * 4, spmd.Layout(["x"], mesh))
    with pytest.raises(NotImplementedError, match="initialize_accelerator_system"):
        t.sum()


def test_demo_as_two_clients():
    """`spmd demo --clients 2`: the GPT demo as 2 client processes; only client 0 prints; same loss curve."""
    cmd = [sys.executable, "-m", "spmd.cli", "demo", "--clients", "2", "--steps", "3", "--batch-size", "8",
           "--block-size", "16", "--d-model", "32"]
    env = dict(clients.clean_env(), SPMD_COLLECTIVE_TIMEOUT="30")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and its clients
        proc.communicate()
        pytest.fail(f"spmd demo --clients 2 ran past {HARD_TIMEOUT}s")
    assert proc.returncode == 0, err[-3000:]
    assert out.count("loss curves") == 1 and "equal" in out  # client 0 only
    assert "2 clients x 4 devices" in out
