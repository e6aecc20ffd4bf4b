"""Issue 32 point 10: SIGTERM to a multi-rank `generate` while its writer rank is muxing the
mp4 leaves no temp file, no output and no rank behind, and says so in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from headmoe.release.components import resolve_model
from headmoe.testing import spawned_rank_pids

HEADMOE = str(Path(sys.executable).with_name("headmoe"))
ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "tests" / "hooks" / "slow_write"


def log_of(text: bytearray) -> str:
    return text.decode(errors="replace")[-3000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multirank
def test_sigterm_while_muxing_leaves_no_temp_file(tmp_path):
    cache = tmp_path / "cache"
    resolve_model("tiny", cache)
    out = tmp_path / "clip.mp4"
    cmd = [HEADMOE, "generate", "--prompt", "x", "--nproc", "2", "--ulysses-degree", "2",
           "--num-inference-steps", "2", "--cache-dir", str(cache), "--output", str(out),
           "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT / "src")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    text = bytearray()
    readers = [threading.Thread(target=lambda s=s: [text.extend(c) for c in iter(
        lambda: s.read1(4096), b"")], daemon=True) for s in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".clip.mp4.*.tmp")) and proc.poll() is None:
        assert time.monotonic() < deadline, text.decode(errors="replace")[-3000:]
        time.sleep(0.05)
    assert proc.poll() is None, text.decode(errors="replace")[-3000:]
    ranks = spawned_rank_pids(proc.pid)  # the writer (rank 0); rank 1 may be done already
    assert ranks, log_of(text)
    proc.send_signal(signal.SIGTERM)  # what `kill PID` sends the command
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in readers:
        r.join(timeout=5)
    log = text.decode(errors="replace")
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if _alive(p)], log[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"], log[-3000:]
    assert code == 128 + signal.SIGTERM, (code, log[-3000:])
    said = [ln for ln in log.splitlines()
            if ln.startswith("headmoe:") and not ln.startswith("headmoe: note:")]
    assert len(said) == 1 and said[0].startswith("headmoe: terminated (SIGTERM)"), log[-3000:]
