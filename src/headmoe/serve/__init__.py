"""`headmoe serve`: resident ranks behind an HTTP video API (FastAPI + uvicorn).

Layering (ARCHITECTURE.md section 6): serve imports pipeline, planner, distributed, models and
config; only `headmoe.cli.serve` imports serve.

- `spec`: `ServeSpec`, the `Deployment` and HTTP settings every rank receives (server-built,
  validated);
- `validate`: the HTTP request schema and its complete validation (the checks of
  ``headmoe generate`` plus the memory estimate) into a `GenerateRequest`;
- `state`: `JobStore`, the thread-safe job table, queue and metrics of rank 0;
- `app`: the FastAPI application over a `JobStore`;
- `wire`: JSON commands between ranks as uint8 tensors (no pickle of client data);
- `worker`: the per-rank loop (model built once, one request after another, cancellation
  decided by rank 0 at step boundaries);
- `supervisor`: local ranks in spawned processes, a dead rank ending the server.
"""
