"""`ServeSpec`: the deployment a server runs (what ``headmoe serve``'s flags fix).

It is built and validated by the launching process and travels to every rank (pickled by
the spawn start method: a server-built object, never client data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headmoe.config import ParallelConfig, check_positive_int, check_positive_number, is_int
from headmoe.pipeline.job import GenerateJob
from headmoe.pipeline.request import DTYPES, GenerateRequest
from headmoe.release.components import magi2_components


@dataclass(frozen=True)
class ServeSpec:
    """One server's fixed deployment.

    ``model_config`` is a `Magi2Config` and ``checkpoint`` its weights (`resolve_model`);
    ``model`` is the ``--model`` value a request's optional ``model`` field must equal.
    ``memory_bytes`` is the per-rank budget of the memory estimate (None: no check).
    ``timeout_s`` bounds every collective; ``drain_timeout_s`` how long SIGTERM lets the
    current job run before cancelling it; ``tick_s`` how often idle ranks hear from rank 0.
    """

    parallel: ParallelConfig
    model_config: Any
    checkpoint: str
    model: str
    dtype: str
    output_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16
    timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    memory_bytes: int | None = None
    tick_s: float = 0.5
    log_level: str = "warning"
    release: Any = None
    """The checked `headmoe.release.folder.Release` (text encoder and decoders), or None
    for a bare transformer checkpoint with the stand-in encoders (as `generate`)."""
    deployment: Any = None
    """The `headmoe.admission.Deployment` every request is admitted on (rank 0)."""
    offload_layers: bool = False
    """Stream the transformer's layers (``--offload-layers``; `GenerateJob`'s field)."""
    resident_layers: int = 0

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may give, none of them a server path: the
        recipe's preset name (``magi2-preview`` / ``tiny``), the release's Hugging Face id
        for a MAGI-2 Preview model, and ``--model`` when it is a preset name."""
        from headmoe.models.magi2.config import PRESETS
        from headmoe.pipeline.recipe import RELEASED, recipe_for
        from headmoe.pipeline.released import RELEASED_MODEL_ID

        try:
            recipe = recipe_for(self.model_config)
        except AttributeError:  # a stand-in config without a schema (tests)
            recipe = None
        names = [] if recipe is None else [recipe.name]
        if recipe is RELEASED:
            names.append(RELEASED_MODEL_ID)
        if self.model in (*PRESETS, "tiny"):
            names.append(self.model)
        return tuple(dict.fromkeys(names))

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.parallel.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.parallel.data_parallel_size}: serve runs each "
                "request over the whole world; it must be 1"
            )
        check_positive_int("max_queue", self.max_queue)
        if not is_int(self.port) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("timeout_s", "drain_timeout_s", "tick_s"):
            check_positive_number(name, getattr(self, name))
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out for no authentication)")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def has_refiner(self) -> bool:
        """The release has ``refiner/``: the ranks load it at start and run 1080p requests."""
        return self.release is not None and self.release.refiner is not None

    def job(self, request: GenerateRequest, output: str | None, extra: dict[str, Any],
            image: Any = None, refiner: Any = None) -> GenerateJob:
        """The `GenerateJob` of ``request`` (and its I2V ``image``, its 1080p ``refiner``
        `RefinerStage`) under this deployment (no progress bar)."""
        return GenerateJob(
            request,
            self.parallel,
            self.model_config,
            self.checkpoint,
            output,
            timeout_s=self.timeout_s,
            progress=False,
            extra=extra,
            release=self.release,
            image=image,
            refiner=refiner,
            offload_layers=self.offload_layers,
            resident_layers=self.resident_layers,
            components=magi2_components,
        )
