"""`headmoe serve`: resident ranks and an HTTP video API (see docs/serving.md).

The deployment flags (model, dtype, layout, ``--nproc``, ``--timeout``) are those of
``headmoe generate`` (`headmoe.cli.flags`) and are checked by the same code
(`headmoe.deployment.build_deployment`, then one `admit`) before any rank starts; errors name the flags and exit with code 2. Then:

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) this process is one rank;
- with one rank the server runs in this process;
- with ``--nproc N`` N local ranks start in spawned processes, watched by this one
  (`headmoe.serve.supervisor`): a rank that dies stops the server with exit code 1.

SIGTERM (or Ctrl-C) drains: no new jobs, the current one finishes or is cancelled after
``--drain-timeout`` s, exit 0.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from headmoe.admission import admit
from headmoe.cli import checks, flags
from headmoe.deployment import build_deployment
from headmoe.distributed.launch import torchrun_env
from headmoe.errors import Refusal, UserError
from headmoe.serve.spec import ServeSpec
from headmoe.serve.store import check_state_dir, default_state_dir

#: a server's default ``--max-time``: a request estimated over an hour is refused (422)
SERVE_MAX_TIME_S = 3600.0


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="resident ranks behind an HTTP video API",
        description="Load the model once on every rank and serve /v1/videos over HTTP. "
        "Request fields a client leaves out take the model's recipe (see 'headmoe generate "
        "--help'); docs/serving.md lists the fields and limits.",
    )
    flags.add(
        p, "model", "model_config", "cache_dir", "dtype", *flags.LAYOUT_FIELDS,
        "offload_layers", "resident_layers", "expert_format", "attention", "cuda_graphs", "nproc",
        "timeout",
        model={"help": "'tiny' (the default), a release folder or a checkpoint path"},
        model_config={"help": "transformer configuration: a preset or a JSON file (as "
                      "generate)"},
        cache_dir={"help": "where 'tiny' is written once (default: ~/.cache/headmoe)"},
        dtype={"help": "transformer dtype of every request (default: the model's recipe: "
               "fp32 for the tiny release; MAGI-2 Preview: bf16 on a GPU, fp32 on a CPU)"},
        nproc={"help": "local ranks (default: the layout's world size); not under torchrun"},
        timeout={"default": 300.0, "help": "seconds any collective may wait; a rank silent "
                 "that long ends the server (default: 300)"})
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="0 picks a free port (printed) (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (keeps it out of the process list)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="queued jobs before 429 (default: 16)")
    p.add_argument("--output-dir", default="headmoe-videos",
                   help="where <id>.mp4/.json go (default: headmoe-videos)")
    flags.add(p, "state_dir")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets the current job run before cancelling it "
                   "(default: 30)")
    flags.add(p, "max_memory_gib", "max_time",
              max_memory_gib={"aliases": ("--memory-gib",)},
              max_time={"default": SERVE_MAX_TIME_S, "help": flags.time_help(SERVE_MAX_TIME_S)})
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: warning)")
    p.set_defaults(run=run)


#: the smallest request, admitted at start: the model alone must fit the budget
SMALLEST = {"prompt": "", "height": 16, "width": 16, "num_frames": 1}
#: with the release's refiner/ (loaded at start too), the smallest request that runs it
SMALLEST_REFINED = {**SMALLEST, "refiner_height": 16, "refiner_width": 16, "refiner_steps": 1}


def _check_output_dir(value: str) -> str:
    """``--output-dir`` as an absolute path: an existing writable folder, or one that can
    be created (its nearest existing parent is a writable folder)."""
    path = os.path.abspath(os.path.expanduser(value))
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a folder" if not os.path.isdir(probe) else "is not writable"
        raise ValueError(f"--output-dir {value!r}: {probe!r} {why}, pick a writable folder")
    return path


def _check_host(host: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} is not a valid address ({exc}), e.g. 127.0.0.1 "
                         "or 0.0.0.0") from None


def build_spec(args: argparse.Namespace) -> tuple[ServeSpec, int]:
    """Validate every flag (the deployment's, as generate's, plus the server's) and build
    the `ServeSpec` and the world size: the `Deployment` (`build_deployment`) and one
    `admit` of the smallest request (the weights alone must fit). Raises `ValueError`
    naming the flags."""
    output_dir = _check_output_dir(args.output_dir)
    state_dir = str(default_state_dir(output_dir) if args.state_dir is None
                    else os.path.abspath(os.path.expanduser(args.state_dir)))
    env = torchrun_env()
    if env is None or env.rank == 0:  # a corrupt, foreign or held database: refused first
        check_state_dir(state_dir, output_dir)
    _check_host(args.host)
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.drain_timeout < math.inf:
        raise ValueError(f"--drain-timeout must be > 0 seconds, got {args.drain_timeout!r}")
    _api_key(args)
    try:
        dep = build_deployment(flags.options_of(args, image_encoder=None, server=True,
                                                dtype=args.dtype))
        # with refiner/ (loaded at start, it stays) both stages' weights must fit
        admitted = admit(SMALLEST_REFINED if dep.has_refiner else SMALLEST, dep)
        checks.check_weights(dep, False)
    except Refusal as exc:  # the smallest request: the model alone does not fit
        raise ValueError("the weights alone do not fit: "
                         + flags.refusal_text(exc.field, exc.message)) from None
    except ValueError as exc:
        kind = UserError if isinstance(exc, UserError) else ValueError
        raise kind(flags.as_flags(str(exc))) from None
    checks.print_admitted(admitted.notes, dep)
    spec = ServeSpec(deployment=dep, output_dir=output_dir, state_dir=state_dir,
                     host=args.host, port=args.port,
                     api_key=args.api_key, max_queue=args.max_queue,
                     drain_timeout_s=args.drain_timeout, log_level=args.log_level)
    return spec, dep.parallel.world_size


def _api_key(args: argparse.Namespace) -> None:
    """``--api-key`` / ``--api-key-file`` into ``args.api_key`` (one of them, not empty)."""
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        try:
            args.api_key = Path(args.api_key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file!r}: {exc.strerror}") from None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out for no authentication)")


def _port_free(host: str, port: int) -> bool:
    """Try to listen on ``host:port`` before any rank starts or any weight loads (rank 0
    binds it for real later); print one line and return False when that fails."""
    from headmoe.serve.worker import bind

    try:
        bind(host, port).close()
    except OSError as exc:
        print(f"headmoe serve: error: {exc} (--host {host} --port {port}), pick another "
              "--port or stop the process that holds it", file=sys.stderr)
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Run ``headmoe serve``; returns the exit code."""
    try:
        spec, world = build_spec(args)
    except ValueError as exc:
        print(f"headmoe serve: error: {exc}", file=sys.stderr)
        return 2
    env = torchrun_env()
    if env is None or env.rank == 0:
        if args.model == "tiny":
            from headmoe.release.folder import RANDOM_WEIGHTS_NOTE

            print(f"headmoe serve: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
        print(f"headmoe serve: checked the flags and the model folder; starting {world} "
              "rank(s)", file=sys.stderr, flush=True)
        if not _port_free(spec.host, spec.port):
            return 2
    if env is None and world > 1:
        from headmoe.serve.supervisor import run_local

        return run_local(spec, world)
    from headmoe.distributed.context import set_rank_threads
    from headmoe.serve.worker import serve_rank

    rank = 0 if env is None else env.rank
    set_rank_threads(1 if env is None else env.local_world_size)
    try:
        serve_rank(spec, rank, world)
    except Exception as exc:  # noqa: BLE001 - one line for the operator, traceback above
        import traceback

        traceback.print_exc()
        print(f"headmoe serve: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
