"""Multi-client failures: clients that die, stall, or run different programs get a `CollectiveError` (or the
ValueError of their mistake) that names the cause, on every client, without waiting out the timeout where it can
be avoided. Real 2-process runs on 127.0.0.1 (gloo), each under a hard timeout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import clients

WORKER = Path(__file__).with_name("multiclient_failure_worker.py")
HARD_TIMEOUT = 90
CHECK = {"SPMD_CHECK_COLLECTIVES": "1"}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def launch(scenario, **kwargs) -> list:
    return clients.launch([WORKER, scenario], hard_timeout=HARD_TIMEOUT, **kwargs)[0]


# -- a client dies or stalls -----------------------------------------------------------------------------------------
def test_client_killed_in_bucketed_backward_fails_fast():
    """A client that dies while the buckets of a backward are in flight: the other gets a CollectiveError naming
    the bucket's all-reduce, within the collective timeout."""
    timeout = 4
    r = launch("killed_in_backward", timeout_s=timeout, wait_for=(0,))[0]
    assert r["type"] == "CollectiveError", r
    assert "gradient bucket" in r["error"] and "client(s) [1]" in r["error"], r
    assert r["elapsed"] < timeout + 3


def test_dead_client_fails_fast():
    """A client that exits before a collective: the other gets a CollectiveError naming it and the collective."""
    timeout = 4
    r = launch("dead_client", timeout_s=timeout, wait_for=(0,))[0]
    assert r["type"] == "CollectiveError", r
    assert "client 0 of 2" in r["error"] and "all_gather" in r["error"] and "client(s) [1]" in r["error"]
    assert r["elapsed"] < timeout + 3


def test_crashing_client_fails_the_others_fast():
    """A client that raises (an unhandled exception) leaves at once: the others fail long before the timeout."""
    r = launch("dead_client", timeout_s=60, env={"SPMD_TEST_FAULT": "raise"}, wait_for=(0,))[0]
    assert r["type"] == "CollectiveError" and "client(s) [1]" in r["error"], r
    assert r["elapsed"] < 10


def test_stalled_client_times_out():
    """A client that stalls (alive, never joins the collective): the other fails after the configured timeout."""
    timeout = 3
    r = launch("dead_client", timeout_s=timeout, env={"SPMD_TEST_FAULT": "stall"}, wait_for=(0,))[0]
    assert r["type"] == "CollectiveError", r
    assert "client(s) [1]" in r["error"] and "all_gather" in r["error"] and f"timeout is {timeout}s" in r["error"]
    assert timeout - 0.5 < r["elapsed"] < timeout + 3


# -- clients that disagree -------------------------------------------------------------------------------------------
def test_mesh_disagreement_is_an_error_on_every_client():
    for c, r in enumerate(launch("mismatch")):
        assert r["type"] == "ValueError", r
        assert "m|x=4" in r["error"] and "m|x=2,y=2" in r["error"] and f"client {c} creates" in r["error"]


def test_clients_gathering_different_sizes_both_raise_with_the_check_on():
    """With SPMD_CHECK_COLLECTIVES=1 (docs/multiclient.md, Limits) both clients raise; without it gloo aborts one."""
    results = launch("disagreeing_sizes", env=CHECK)
    for c, r in enumerate(results):
        assert r["type"] == "CollectiveError", r
        assert r["error"].startswith(f"client {c} of 2: the clients [0, 1] disagree on a collective over mesh dim(s) "
                                     "['x']")
        assert "client 0: all_gather(axis 0) of torch.float32 components of shape [4]; client 1: all_gather(axis 0) " \
               "of torch.float32 components of shape [8]" in r["error"]


def test_a_collective_on_one_client_before_to_global_is_named_on_both_with_the_check_on():
    results = launch("extra_collective_before_to_global", env=CHECK)
    for r in results:
        assert r["type"] == "CollectiveError" and "disagree" in r["error"], r
    assert "(to_global)" in results[0]["error"] + results[1]["error"]


def test_clients_holding_different_device_counts_fail_at_once():
    """The client whose count fits the mesh does not wait out the timeout for the one whose count does not."""
    for c, r in enumerate(launch("unequal_device_counts", timeout_s=30)):
        assert r["type"] == "ValueError" and r["elapsed"] < 5, r
        assert f"client {c} creates '|x=4|CPUx{2 + 2 * c} per client'" in r["error"], r
        assert "num_logical_cpu_devices" in r["error"], r


@pytest.mark.parametrize("scenario, call", [("save_on_one_client", "spmd.checkpoint.save of"),
                                            ("compiled_step_on_one_client", "spmd.function(total)")])
def test_a_call_every_client_must_make_names_itself_when_the_others_leave(scenario, call):
    """Client 0 saves a checkpoint (or calls a compiled function) that client 1 skips, leaving: client 0's error
    says which call failed and why, rather than gloo's bare RuntimeError."""
    r = launch(scenario, timeout_s=5, env={"SPMD_TEST_OTHER": "exit"})[0]
    assert r["type"] == "CollectiveError", r
    assert r["error"].startswith(f"client 0 of 2: {call}") and "other clients could not be reached" in r["error"], r
    assert "SPMD_CHECK_COLLECTIVES=1" in r["error"], r


@pytest.mark.parametrize("scenario, call", [("save_on_one_client", "spmd.checkpoint.save"),
                                            ("compiled_step_on_one_client", "a call of an spmd.function")])
def test_a_call_every_client_must_make_is_named_on_both_with_the_check_on(scenario, call):
    """Client 0 saves (or calls a compiled function) while client 1 runs a reduction, with SPMD_CHECK_COLLECTIVES=1:
    both raise at once, naming what each runs (without the check, gloo's timeout or a wrong match)."""
    results = launch(scenario, timeout_s=30, env=CHECK | {"SPMD_TEST_OTHER": "op"})
    for r in results:
        assert r["type"] == "CollectiveError" and "disagree" in r["error"], r
        assert f"client 0: {call}; client 1: all_reduce(sum) of torch.float32 components of shape []" in r["error"]
        assert r["elapsed"] < 25, r  # not the timeout (the compiled call's trace takes a few seconds here)
