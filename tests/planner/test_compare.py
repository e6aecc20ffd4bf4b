"""`headmoe compare`: run order, flag forwarding and aggregation with a fake runner; one real
two-layout run end to end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from headmoe.cli.compare import main, run_order, subprocess_runner


def test_runs_are_interleaved():
    assert run_order(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


class FakeRunner:
    """Writes a sidecar per command: step maxima and hashes chosen per layout."""

    def __init__(self, hashes: dict[str, str]):
        self.cmds: list[list[str]] = []
        self.hashes = hashes

    def __call__(self, cmd: list[str]) -> None:
        self.cmds.append(cmd)
        out = Path(cmd[cmd.index("--output") + 1])
        sp = int(cmd[cmd.index("--ulysses-degree") + 1])
        run = len(self.cmds)
        counters = {str(r): {"moe_calls": 6, "moe_rows_max_per_call": 100 * sp + r,
                             "exchanges": {"moe_scatter": {"bytes_sent": 3 * (r + 1) << 20},
                                           "ulysses_in": {"bytes_sent": 6 << 20}}}
                    for r in range(sp)}
        side = {"model": {"name": "not-a-preset"},
                "request": {"num_inference_steps": 3},
                "step_times_s": {"max": [9.0, 1.0 * run, 3.0 * run]},
                "video_sha256": self.hashes[f"sp{sp}"], "audio_sha256": "a" * 64,
                "counters": counters}
        out.with_suffix(".json").write_text(json.dumps(side))


def test_compare_forwards_flags_and_aggregates(tmp_path, capsys):
    fake = FakeRunner({"sp1": "v" * 64, "sp2": "v" * 64})
    argv = ["--layouts", "sp1", "sp2", "--repeat", "2", "--json", "--output-dir", str(tmp_path),
            "--prompt", "a fox", "--num-inference-steps", "3", "--seed", "5"]
    assert main(argv, runner=fake) == 0
    order = [c[c.index("--ulysses-degree") + 1] for c in fake.cmds]
    assert order == ["1", "2", "1", "2"]
    assert [c[c.index("--nproc") + 1] for c in fake.cmds] == order
    for c in fake.cmds:
        assert "--prompt=a fox" in c and "--seed=5" in c and "--json" not in c
    rows = json.loads(capsys.readouterr().out)["layouts"]
    # runs 1 and 3 are sp1: steps after the first average to 2*run -> 2 and 6 -> mean 4
    assert rows[0]["step_time_s_per_run"] == [2.0, 6.0] and rows[0]["step_time_s"] == 4.0
    assert rows[1]["step_time_s"] == 6.0
    assert rows[1]["busiest_moe_rows"] == 201
    # busiest sender (rank 1: 6 MiB) over 3 steps
    assert rows[1]["moe_bytes_sent_per_rank_per_step"] == 2 << 20
    assert rows[1]["bytes_sent_per_rank_per_step"] == 4 << 20
    assert all(r["same_as_first"] for r in rows)
    assert all(r["counters_match_plan"] is None for r in rows)  # no prediction: not a preset


def test_compare_reports_different_bytes(tmp_path, capsys):
    fake = FakeRunner({"sp1": "v" * 64, "sp2": "w" * 64})
    argv = ["--layouts", "sp1", "sp2", "--output-dir", str(tmp_path), "--prompt", "x"]
    assert main(argv, runner=fake) == 1
    assert "**NO**" in capsys.readouterr().out


@pytest.mark.parametrize("layouts", [["sp3,ep2"], ["sp2", "sp2,ep2"], ["sp2,fast"]])
def test_compare_rejects_bad_layouts_before_running(layouts, tmp_path, capsys):
    fake = FakeRunner({})
    assert main(["--layouts", *layouts, "--output-dir", str(tmp_path), "--prompt", "x"],
                runner=fake) == 2
    assert fake.cmds == [] and "error" in capsys.readouterr().err


@pytest.mark.multirank
def test_compare_end_to_end(tmp_path, capsys):
    # one real 2-rank run (the 4-layout comparison is in docs/benchmarks.md): the
    # sidecar's counters, summed over 2 steps, equal the planner's prediction
    argv = ["--layouts", "sp2,cfg1", "--json", "--output-dir", str(tmp_path),
            "--prompt", "a fox", "--num-inference-steps", "2"]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)["layouts"]
    assert row["layout"] == "sp2" and row["counters_match_plan"] and row["same_as_first"]
    assert len(row["video_sha256"]) == 64 and row["ulysses_bytes_sent_per_rank_per_step"] > 0


def test_subprocess_runner_kills_a_run_past_its_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ran past --run-timeout=0.5 s"):
        subprocess_runner([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="exited with 3"):
        subprocess_runner([sys.executable, "-c", "raise SystemExit(3)"], timeout=30)
    assert main(["--layouts", "sp1", "--prompt", "x", "--run-timeout", "0"]) == 2

