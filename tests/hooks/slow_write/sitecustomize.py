"""Test hook (tests/cli/test_sigterm_while_writing.py puts this folder on PYTHONPATH): the
mp4 writer of every process holds its temp file open for a while after writing it, so a
signal can be sent while the file is being written. Nothing in src/ reads this."""

import time

import headmoe.pipeline.media as media

_atomic_write = media.atomic_write


def _slow_atomic_write(path, write, **kwargs):
    def slow(tmp):
        write(tmp)
        if str(path).endswith(".mp4"):
            print(f"slow-write-hook: {tmp}", flush=True)
            time.sleep(60)

    _atomic_write(path, slow, **kwargs)


media.atomic_write = _slow_atomic_write
