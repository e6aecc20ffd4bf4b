"""The three local launchers (elastic `launch_local`, serve's supervisor, the test harness)
share one failure grace and one "who failed first" rule (restated rule 18)."""

from types import SimpleNamespace

import headmoe.serve.supervisor as supervisor
import headmoe.testing.multirank as multirank
from headmoe.cli.errors import describe
from headmoe.distributed import launch
from headmoe.distributed.launch import FAILURE_GRACE_S, LaunchFailure, failure_order


def test_one_grace_for_every_launcher():
    assert supervisor.FAILURE_GRACE_S is FAILURE_GRACE_S
    assert multirank.FAILURE_GRACE_S is FAILURE_GRACE_S
    assert launch.FAILURE_GRACE_S > 0


def test_root_cause_first():
    texts = {0: "RuntimeError: Connection closed by peer", 1: "killed by signal 9",
             2: "RankUnresponsive: rank 3 (last at step 2/8) stopped responding: ..."}
    assert failure_order(texts) == [1, 2, 0]
    assert failure_order({0: "a", 1: "b", 2: "c"}, {0: 5.0, 1: 3.0}) == [1, 0, 2]


def test_generate_and_serve_name_the_same_rank(tmp_path):
    summaries = {0: "RuntimeError: Connection closed by peer", 2: "killed by signal 9"}
    _, message = describe(LaunchFailure(summaries, summaries), "generate")
    assert message.startswith("rank 2 failed: killed by signal 9")
    procs = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=None),
             SimpleNamespace(exitcode=-9)]
    (tmp_path / "rank0.txt").write_text("12.5\nTraceback ...\nRuntimeError: closed by peer\n")
    assert supervisor._culprit(procs, tmp_path) == (2, "died (killed by signal 9)", "")
    procs[2].exitcode = 1
    (tmp_path / "rank2.txt").write_text("11.0\nTraceback ...\nValueError: boom\n")
    rank, reason, text = supervisor._culprit(procs, tmp_path)
    assert (rank, reason) == (2, "failed: ValueError: boom") and "Traceback" in text
