"""Untrusted images are decoded in a child process, bounded in memory and in time.

`read_image` (a file: ``generate --image``) and `prepare_isolated` (bytes) run
`headmoe.pipeline.image.prepare_image` in a fresh Python process (this module under a bare
``headmoe`` package, `_CHILD`: numpy and Pillow only, no torch, so it starts in a fraction
of a second), so that a hostile file can neither grow the caller's memory (the child's is
returned to the system when it exits, and its address space is capped at
`CHILD_MEMORY_BYTES`) nor hold the caller's GIL. The child is killed after
`DECODE_TIMEOUT_S` seconds, or as soon as ``cancelled`` is set (the HTTP client went away).
The file-level checks (byte cap) run here first, so an oversized file never reaches a child.

The child reads ``height width what`` from its arguments and the file from stdin, and
writes one reply: an 8-byte length, a JSON header (``{"facts": ...}`` or ``{"error":
message}``), then the preprocessed pixels. Nothing from the child is unpickled.
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import threading
import time
from typing import IO, cast

from headmoe.pipeline.image import (
    MAX_DECODE_BYTES,
    MAX_IMAGE_BYTES,
    ImageError,
    ReferenceImage,
    check_bytes,
    prepare_image,
)

#: seconds a child has to decode and preprocess one image
DECODE_TIMEOUT_S = 15.0
#: the child's address-space cap beyond what it holds after its imports
CHILD_MEMORY_BYTES = MAX_DECODE_BYTES + (256 << 20)
#: how often the caller checks ``cancelled`` while the child runs (seconds)
_POLL_S = 0.1
#: the child's program: this module, imported under a bare ``headmoe`` package, so that the
#: package's import-time set-up (torch, oneMKL's mode: headmoe.numerics) is skipped; the
#: child computes nothing with torch, and torch's import would cost seconds per image
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHILD = ("import sys, types; pkg = types.ModuleType('headmoe'); "
          f"pkg.__path__ = [{_PACKAGE!r}]; sys.modules['headmoe'] = pkg; "
          "from headmoe.pipeline.image_worker import main; sys.exit(main(sys.argv[1:]))")


def prepare_isolated(data: bytes, height: int, width: int, what: str = "the image",
                     timeout_s: float | None = None,
                     cancelled: threading.Event | None = None) -> ReferenceImage:
    """`prepare_image` of ``data`` in a child process (module doc). Raises `ImageError`
    naming ``what``: the image's own refusals, a decode past ``timeout_s`` (default
    `DECODE_TIMEOUT_S`) or past the child's memory, or `ImageCancelled`."""
    check_bytes(data, what)
    limit = DECODE_TIMEOUT_S if timeout_s is None else timeout_s
    cmd = [sys.executable, "-c", _CHILD, str(height), str(width), what]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        out = _communicate(proc, bytes(data), limit, cancelled, what)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in _pipes(proc):
            pipe.close()
    return _reply(out, proc.returncode, what)


def read_image(path: str, height: int, width: int) -> ReferenceImage:
    """`prepare_image` of the file at ``path`` (at most `MAX_IMAGE_BYTES` are read; the
    path must be a regular file), in a child process bounded in memory and time
    (`prepare_isolated`). Raises `ImageError` naming ``path``."""
    what = f"--image {path!r}"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{what} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"{what} cannot be read: {exc.strerror or exc}") from None
    return prepare_isolated(data, height, width, what)


class ImageCancelled(ImageError):
    """The decode was abandoned because its requester went away."""


def _pipes(proc: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """The child's stdin and stdout (both exist: it is started with ``stdin=PIPE,
    stdout=PIPE``)."""
    return cast(IO[bytes], proc.stdin), cast(IO[bytes], proc.stdout)


def _communicate(proc: subprocess.Popen[bytes], data: bytes, limit: float,
                 cancelled: threading.Event | None, what: str) -> bytes:
    """Feed ``data`` to the child and collect its reply (threads: a pipe never blocks the
    deadline); raise once ``limit`` passes or ``cancelled`` is set (the caller kills it)."""
    out: list[bytes] = []
    stdin, stdout = _pipes(proc)

    def feed() -> None:
        try:
            stdin.write(data)
            stdin.close()
        except (OSError, ValueError):  # the child died (or was killed) before reading everything
            pass

    threads = [threading.Thread(target=feed, daemon=True),
               threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit
    try:
        while proc.poll() is None:
            if cancelled is not None and cancelled.is_set():
                raise ImageCancelled(f"{what}: the decode was cancelled (the client went "
                                     "away)")
            if time.monotonic() > deadline:
                raise ImageError(f"{what} took more than {limit:g} s to decode; refused")
            try:
                proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
        for t in threads:
            t.join(timeout=5)
    return out[0] if out else b""


def _reply(out: bytes, code: int, what: str) -> ReferenceImage:
    size = int.from_bytes(out[:8], "big") if len(out) >= 8 else -1
    if code != 0 or size < 0 or len(out) < 8 + size:
        raise ImageError(f"{what} could not be decoded within "
                         f"{CHILD_MEMORY_BYTES >> 20} MiB (the decoder exited with {code})")
    head = json.loads(out[8:8 + size])
    if "error" in head:
        raise ImageError(head["error"])
    facts = head["facts"]
    facts["source_size"] = tuple(facts["source_size"])
    return ReferenceImage(**facts, pixels=out[8 + size:])


def _cap_memory() -> None:
    try:
        with open("/proc/self/statm") as f:
            held = int(f.read().split()[0]) * resource.getpagesize()
        cap = held + CHILD_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError):  # not Linux: the decode budget alone bounds it
        pass


def main(argv: list[str]) -> int:
    height, width, what = int(argv[0]), int(argv[1]), argv[2]
    data = sys.stdin.buffer.read()
    _cap_memory()
    head: dict[str, object]
    try:
        ref = prepare_image(data, height, width, what)
    except ImageError as exc:
        head, pixels = {"error": str(exc)}, b""
    else:
        head, pixels = {"facts": {**ref.describe()}}, ref.pixels or b""
    blob = json.dumps(head).encode()
    sys.stdout.buffer.write(len(blob).to_bytes(8, "big") + blob + pixels)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
