"""The one launcher (`headmoe.distributed.launch`) of generate, serve's supervisor and the
test harness: one rendezvous, one error-file protocol, one "who failed first" rule."""

import os
import signal
import time

import pytest
import torch

import headmoe.serve.supervisor as supervisor
import headmoe.testing.multirank as multirank
from headmoe.cli.errors import describe
from headmoe.distributed import launch
from headmoe.distributed.launch import (
    FAILURE_GRACE_S,
    LaunchFailure,
    LaunchTimeout,
    LocalRanks,
    failure_order,
    launch_local,
    read_error,
    torchrun_env,
    write_error,
)


def test_one_launcher_for_every_user():
    assert supervisor.LocalRanks is LocalRanks
    assert multirank.launch_local is launch_local
    assert multirank.RankFailure is LaunchFailure and multirank.RankTimeout is LaunchTimeout
    for module in (supervisor, multirank):  # no grace, poll or error file of their own
        assert not {"FAILURE_GRACE_S", "POLL_S", "_watch", "_collect"} & set(vars(module))
    assert launch.FAILURE_GRACE_S > 0


def test_root_cause_first():
    texts = {0: "RuntimeError: Connection closed by peer", 1: "killed by signal 9",
             2: "RankUnresponsive: rank 3 (last at step 2/8) stopped responding: ..."}
    assert failure_order(texts) == [1, 2, 0]
    assert failure_order({0: "a", 1: "b", 2: "c"}, {0: 5.0, 1: 3.0}) == [1, 0, 2]


def test_generate_and_serve_name_the_same_rank():
    summaries = {0: "RuntimeError: Connection closed by peer", 2: "killed by signal 9"}
    failure = LaunchFailure({0: "Traceback ...\nRuntimeError: closed by peer\n",
                             2: "killed by signal 9"}, summaries, times={0: 12.5})
    _, message = describe(failure, "generate")
    assert message.startswith("rank 2 failed: killed by signal 9")
    assert supervisor._culprit(failure) == (2, "died (killed by signal 9)", "")
    failure = LaunchFailure({0: "Traceback ...\nRuntimeError: closed by peer\n",
                             2: "Traceback ...\nValueError: boom\n"},
                            {0: "RuntimeError: closed by peer", 2: "ValueError: boom"},
                            times={0: 12.5, 2: 11.0})
    rank, reason, text = supervisor._culprit(failure)
    assert (rank, reason) == (2, "failed: ValueError: boom") and "Traceback" in text
    assert describe(failure, "generate")[1].startswith("rank 2 failed: boom")  # the earliest


def test_error_file_protocol(tmp_path):
    assert read_error(tmp_path, 0, None) is None and read_error(tmp_path, 0, 0) is None
    assert read_error(tmp_path, 0, 3).summary == "exited with code 3"
    try:
        raise ValueError("height must be\n a multiple of 16")
    except ValueError as exc:
        t0 = time.time()
        write_error(tmp_path, 1, exc)
    error = read_error(tmp_path, 1, None)  # recorded: failed even before it exits
    assert error.summary == "ValueError: height must be a multiple of 16"
    assert "Traceback" in error.text and "test_error_file_protocol" in error.text
    assert t0 <= error.time <= time.time()
    assert read_error(tmp_path, 1, -9).text == "killed by signal 9"  # whatever it wrote
    assert [p.name for p in tmp_path.iterdir()] == ["rank1.error"]  # no temp file stays


def _join_and_sum(scale):
    """A launched rank: its place from the environment, the launcher's store, env://."""
    import torch.distributed as dist

    env = torchrun_env()
    dist.init_process_group("gloo", init_method="env://")
    x = torch.full((3,), float(env.rank + 1))
    dist.all_reduce(x)
    dist.destroy_process_group()
    return {"env": env, "port": os.environ["MASTER_PORT"], "sum": x * scale}


def _fail_one(how):
    rank = torchrun_env().rank
    if rank == 1 and how == "raise":
        raise ValueError("boom from rank one")
    if rank == 1 and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # hung: killed after the grace (or the timeout)


@pytest.mark.multirank
def test_ranks_join_one_store_and_return_by_value():
    results = launch_local(_join_and_sum, 2, (torch.tensor(2.0),))
    assert [r["env"] for r in results] == [launch.RankEnv(0, 2, 0, 2), launch.RankEnv(1, 2, 1, 2)]
    assert results[0]["port"] == results[1]["port"]
    assert all(torch.equal(r["sum"], torch.full((3,), 6.0)) for r in results)


@pytest.mark.multirank
def test_failures_are_reported_then_the_rest_killed(monkeypatch):
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 2.0)
    with pytest.raises(LaunchFailure) as info:
        launch_local(_fail_one, 2, ("raise",))
    err = info.value
    assert err.summaries == {1: "ValueError: boom from rank one"} and err.hung == [0]
    assert "_fail_one" in err.failures[1] and 1 in err.times and err.order == [1]
    with pytest.raises(LaunchFailure) as info:
        launch_local(_fail_one, 2, ("kill",))
    assert info.value.failures == {1: "killed by signal 9"} and info.value.hung == [0]
    t0 = time.monotonic()
    with LocalRanks(_fail_one, 2, ("hang",)) as ranks, pytest.raises(LaunchTimeout) as late:
        ranks.wait(timeout=1)
    assert late.value.hung == [0, 1] and time.monotonic() - t0 < 1 + FAILURE_GRACE_S
    assert ranks.alive() == [] and not ranks.folder.exists()
