"""`headmoe serve`: resident ranks and an HTTP video API (see docs/serving.md).

The deployment flags (model, dtype, layout, ``--nproc``, ``--timeout``) are those of
``headmoe generate`` and are checked by the same code (`headmoe.cli.generate.build_job`)
before any rank starts; errors name the flags and exit with code 2. Then:

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) this process is one rank;
- with one rank the server runs in this process;
- with ``--nproc N`` N local ranks start in spawned processes, watched by this one
  (`headmoe.serve.supervisor`): a rank that dies stops the server with exit code 1.

SIGTERM (or Ctrl-C) drains: no new jobs, the current one finishes or is cancelled after
``--drain-timeout`` s, exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from headmoe.config import MOE_EXCHANGES
from headmoe.pipeline.request import DTYPES, GenerateRequest

GIB = 1 << 30


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="resident ranks behind an HTTP video API",
        description="Load the model once on every rank and serve /v1/videos over HTTP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="'tiny', a release folder or a checkpoint path")
    p.add_argument("--model-config", default=None, help="preset of a checkpoint without config.json")
    p.add_argument("--cache-dir", default="~/.cache/headmoe", help="where 'tiny' is written once")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--ulysses-degree", type=int, default=1)
    p.add_argument("--cfg-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1, help="must be 1 (reserved)")
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--expert-parallel-size", type=int, default=None,
                   help="EP degree (divides --ulysses-degree); default: the SP group")
    p.add_argument("--moe-exchange", choices=MOE_EXCHANGES, default="auto")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks (default: the layout's world size); not under torchrun")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective may wait; a rank silent that long ends the server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (keeps it out of the process list)")
    p.add_argument("--max-queue", type=int, default=16, help="queued jobs before 429")
    p.add_argument("--output-dir", default="headmoe-videos", help="where <id>.mp4/.json go")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets the current job run before cancelling it")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="per-rank memory budget of the request estimate (default: GPU memory, "
                        "or RAM / ranks on CPU; 0: no check)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=run)


#: generate flags a server fixes for every request (its outputs are server-named files;
#: the memory check is the server's own, against --memory-gib)
GENERATE_ONLY = {"overwrite": True, "max_memory_gib": None, "check_weights": False,
                 "prompt_file": None, "video_decoder": None, "offload": False,
                 "offload_layers": False, "resident_layers": 0}


def _memory_budget(args: argparse.Namespace, world: int) -> int | None:
    if args.memory_gib is not None:
        if args.memory_gib < 0:
            raise ValueError(f"--memory-gib must be >= 0, got {args.memory_gib!r}")
        return None if args.memory_gib == 0 else int(args.memory_gib * GIB)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world


def build_spec(args: argparse.Namespace) -> tuple[Any, int]:
    """Validate every flag (generate's checks plus the server's) and build the `ServeSpec`
    and the world size. Raises `ValueError` naming the flags."""
    from headmoe.cli.generate import build_job
    from headmoe.serve.spec import ServeSpec
    from headmoe.serve.validate import estimate_rank_bytes

    if args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size must be 1 for serve, got {args.data_parallel_size}")
    defaults = {f.name: f.default for f in fields(GenerateRequest)}
    gen = argparse.Namespace(**{**defaults, **GENERATE_ONLY, **vars(args), "prompt": "",
                                "output": "serve.mp4",
                                "no_progress": True})
    job, world = build_job(gen)
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.drain_timeout <= 0:
        raise ValueError(f"--drain-timeout must be > 0 seconds, got {args.drain_timeout!r}")
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        try:
            args.api_key = Path(args.api_key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file!r}: {exc.strerror}") from None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty (leave it out for no authentication)")
    spec = ServeSpec(job.parallel, job.model_config, job.checkpoint, args.model, args.dtype,
                     os.path.abspath(os.path.expanduser(args.output_dir)), args.host, args.port,
                     args.api_key, args.max_queue, args.timeout, args.drain_timeout,
                     _memory_budget(args, world), log_level=args.log_level,
                     release=job.release)
    weights, act = estimate_rank_bytes(spec, GenerateRequest(prompt="", dtype=args.dtype))
    if spec.memory_bytes is not None and weights + act > spec.memory_bytes:
        raise ValueError(f"the model needs an estimated {(weights + act) / GIB:.2f} GiB per rank, "
                         f"over the --memory-gib budget of {spec.memory_bytes / GIB:.2f} GiB")
    return spec, world


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
    from headmoe.distributed.launch import torchrun_env

    try:
        spec, world = build_spec(args)
    except ValueError as exc:
        print(f"headmoe serve: error: {exc}", file=sys.stderr)
        return 2
    env = torchrun_env()
    if env is None or env.rank == 0:
        if args.model == "tiny":
            from headmoe.pipeline.release import RANDOM_WEIGHTS_NOTE

            print(f"headmoe serve: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
        print(f"headmoe serve: checked the flags and the model folder; starting {world} "
              "rank(s)", file=sys.stderr, flush=True)
        if not _port_free(spec.host, spec.port):
            return 2
    if env is None and world > 1:
        from headmoe.serve.supervisor import run_local

        return run_local(spec, world)
    from headmoe.distributed.launch import set_rank_threads
    from headmoe.serve.worker import serve_rank

    rank = 0 if env is None else env.rank
    set_rank_threads(1 if env is None else env.local_world_size)
    try:
        serve_rank(spec, rank, world, None)
    except Exception as exc:  # noqa: BLE001 - one line for the operator, traceback above
        import traceback

        traceback.print_exc()
        print(f"headmoe serve: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
