"""Two torchrun agents on this machine (`--nnodes 2 --nproc-per-node 2`, c10d rendezvous on
localhost, Gloo) give the bytes of one `--nproc 4` launch, and the text encoder runs on
one rank per node (issue 21 point 4: the README's two-node command, on CPUs).

Never hangs: every process gets a wall-clock limit and is killed (its whole session) when
it passes it; the ranks' collectives time out after `--timeout`; the rendezvous port is
bound and released just before the agents start, and the agent told to host the store
(`is_host=1`) fails at once if another process took it meanwhile."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: seconds a single command may take (loaded 2-core CI machines; the runs take ~20-40 s)
LIMIT_S = 240
#: the tiny request: 4 ranks as SP 2 x CFG 2 (both axes cross the node boundary)
REQUEST = ["--prompt", "a lighthouse at dusk", "--ulysses-degree", "2", "--cfg-parallel-size",
           "2", "--num-inference-steps", "2", "--num-frames", "5", "--height", "32", "--width",
           "32", "--timeout", "60", "--no-progress"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int, str]]:
    """(exit code, stderr tail) of every process; a process still running at `deadline` has
    its session killed (it and every rank it started) and the test fails."""
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, err[-3000:]))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        pytest.fail(f"a command ran past {LIMIT_S} s and was killed")
    return results


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _agents(port: int, cache: Path, out: Path) -> list[subprocess.Popen]:
    """Two torchrun agents of one 2 x 2 job, the first hosting the rendezvous store."""
    procs = []
    for host in (1, 0):
        procs.append(_start([
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"headmoe-{port}",
            "--rdzv-conf", f"is_host={host},join_timeout=90", "--max-restarts", "0",
            "-m", "headmoe.cli.main", "generate", *REQUEST, "--cache-dir", str(cache),
            "--output", str(out),
        ]))  # fmt: skip
    return procs


@pytest.mark.multirank
def test_two_torchrun_nodes_give_the_bytes_of_one_four_rank_launch(tmp_path):
    cache = tmp_path / "cache"
    one = [sys.executable, "-m", "headmoe.cli.main", "generate", *REQUEST, "--nproc", "4",
           "--cache-dir", str(cache), "--output", str(tmp_path / "one.mp4")]  # fmt: skip
    [(code, err)] = _finish([_start(one)], time.monotonic() + LIMIT_S)
    assert code == 0, err
    two = tmp_path / "two.mp4"
    results = _finish(_agents(_free_port(), cache, two), time.monotonic() + LIMIT_S)
    assert all(code == 0 for code, _ in results), results
    ref = json.loads((tmp_path / "one.json").read_text())
    got = json.loads(two.with_suffix(".json").read_text())
    assert got["layout"]["world_size"] == 4 and got["layout"]["ranks"] == [0, 1, 2, 3]
    assert len(ref["video_sha256"]) == 64 and len(ref["audio_sha256"]) == 64
    assert got["video_sha256"] == ref["video_sha256"]
    assert got["audio_sha256"] == ref["audio_sha256"]
    assert two.read_bytes() == (tmp_path / "one.mp4").read_bytes()
    # the prompt and the negative prompt, encoded once per node by the node's first rank
    assert ref["text_encoder_runs"] == {"0": 2, "1": 0, "2": 0, "3": 0}
    assert got["text_encoder_runs"] == {"0": 2, "1": 0, "2": 2, "3": 0}
