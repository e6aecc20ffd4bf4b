"""`ServeSpec`: what a server runs, the `Deployment` and the HTTP settings its flags fix.

It is built and validated by the launching process (`headmoe.cli.serve.build_spec`) and
travels to every rank (pickled by the spawn start method: a server-built object, never
client data).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from headmoe.config import check_positive_int, check_positive_number, is_int
from headmoe.distributed.replicas import replica_config
from headmoe.models.magi2.config import PRESETS
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.image import ReferenceImage
from headmoe.pipeline.job import GenerateJob
from headmoe.pipeline.recipe import REFINER_RESOLUTIONS, RELEASED, RESOLUTIONS
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.released import RELEASED_MODEL_ID
from headmoe.pipeline.request import GenerateRequest
from headmoe.release.components import magi2_components

#: the recipe's defaults `ServeSpec.model_card` lists (the fields the web page's form shows)
_CARD_DEFAULTS = ("negative_prompt", "seed", "num_inference_steps", "height", "width",
                  "num_frames", "fps", "guidance_scale", "audio_guidance_scale", "shift")


@dataclass(frozen=True, kw_only=True)
class ServeSpec:
    """One server: its ``deployment`` (every request is admitted on it and runs with its
    layout, model, dtype and collective timeout) and its HTTP settings. ``output_dir``
    holds the videos, ``state_dir`` the job database (`headmoe.serve.store.JobDatabase`;
    None: jobs live in rank 0's memory only); ``drain_timeout_s`` is how long SIGTERM lets
    the current job run before cancelling it; ``tick_s`` how often idle ranks hear from
    rank 0."""

    deployment: Deployment
    output_dir: str
    state_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16
    drain_timeout_s: float = 30.0
    tick_s: float = 0.5
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.deployment.dtype is None:
            raise ValueError("deployment.dtype must be set: a server runs every request in "
                             "one dtype")
        check_positive_int("max_queue", self.max_queue)
        if not is_int(self.port) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("drain_timeout_s", "tick_s"):
            check_positive_number(name, getattr(self, name))
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out for no authentication)")

    @property
    def replicas(self) -> int:
        """The data-parallel replicas (``--data-parallel-size``): each runs one request at
        a time on its own SP x CFG ranks."""
        return self.deployment.parallel.data_parallel_size

    def replica_spec(self) -> ServeSpec:
        """This server as one replica runs it: the deployment's layout with DP 1 (every
        request's admission, layout and sidecar are one replica's)."""
        if self.replicas == 1:
            return self
        dep = self.deployment
        return replace(self, deployment=replace(dep, parallel=replica_config(dep.parallel)))

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may give, none of them a server path: the
        recipe's preset name (``magi2-preview`` / ``tiny``), the release's Hugging Face id
        for a MAGI-2 Preview model, and ``--model`` when it is a preset name."""
        try:
            recipe = self.deployment.recipe
        except AttributeError:  # a stand-in config without a schema (tests)
            recipe = None
        names = [] if recipe is None else [recipe.name]
        if recipe is RELEASED:
            names.append(RELEASED_MODEL_ID)
        if self.deployment.model in (*PRESETS, "tiny"):
            names.append(self.deployment.model)
        return tuple(dict.fromkeys(names))

    @property
    def takes_images(self) -> bool:
        """The model has an image encoder (a release folder's ``vae/Wan2.2_VAE.pth``), so
        requests may carry an image-to-video image."""
        release = self.deployment.release
        return release is not None and release.image_encoder is not None

    def model_card(self) -> dict[str, object]:
        """The served model as ``GET /v1/models`` lists it (the web page's form is built
        from it): ``id`` (the first of `model_names`), the ``names`` a request's ``model``
        may give, the ``resolutions`` presets a request may name (``"WxH"`` of the clip;
        a refiner preset, 1080p, the refiner's size, only where the refiner stage runs),
        whether it takes an ``image`` and runs the ``refiner``, and the recipe's
        ``defaults`` of the fields a request leaves out (with ``size`` and ``seconds``)."""
        dep = self.deployment
        recipe = dep.recipe
        refiner = dep.refiner_config is not None
        defaults = {k: recipe.default(k, dep.device) for k in _CARD_DEFAULTS}
        height, width = cast(int, defaults["height"]), cast(int, defaults["width"])
        frames, fps = cast(int, defaults["num_frames"]), cast(float, defaults["fps"])
        names = self.model_names
        return {
            "id": names[0] if names else recipe.name, "object": "model", "owned_by": "headmoe",
            "names": list(names),
            "resolutions": {name: f"{w}x{h}" for name, (h, w) in RESOLUTIONS.items()
                            if refiner or name not in REFINER_RESOLUTIONS},
            "image": self.takes_images, "refiner": refiner,
            "defaults": {**defaults, "size": f"{width}x{height}", "seconds": frames / fps},
        }

    def job(self, request: GenerateRequest, output: str | None, extra: dict[str, object],
            image: ReferenceImage | None = None,
            refiner: RefinerStage | None = None) -> GenerateJob:
        """The `GenerateJob` of an admitted ``request`` (and its I2V ``image``, its 1080p
        ``refiner`` stage) on this deployment (no progress bar)."""
        return GenerateJob(deployment=self.deployment, request=request, output=output,
                           image=image, refiner=refiner, extra=extra, progress=False,
                           components=magi2_components)
