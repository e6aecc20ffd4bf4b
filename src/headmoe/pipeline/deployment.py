"""`Deployment`: what every request of one command runs on, decided once.

The spine of every entry point (docs/architecture.md, "The spine")::

    options --build_deployment--> Deployment --admit--> Admitted --> GenerateJob --> ranks

`headmoe.deployment.build_deployment` is the one function that builds a `Deployment` from
the user's options (it reads the release folder and checks the layout); `headmoe.admission`
admits each request on it; a `headmoe.pipeline.job.GenerateJob` is (deployment, admitted
request, output, image) and travels to the ranks. The type lives in the pipeline so that
the per-rank job can hold it: it imports nothing above the pipeline (the release is typed
by the `headmoe.pipeline.interfaces.ReleaseFolder` protocol), and everything in it is
picklable (the spawn start method sends it to every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from headmoe.config import ParallelConfig, is_number
from headmoe.layers.flash_attention import ATTENTION_PATHS
from headmoe.models.magi2 import Magi2Config
from headmoe.models.refiner import Magi2RefinerConfig
from headmoe.models.streaming import split_layers
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT, check_expert_format
from headmoe.pipeline.interfaces import ReleaseFolder
from headmoe.pipeline.recipe import Recipe, recipe_for

#: the shortest collective timeout (s): below it the ranks cannot even join the group
MIN_TIMEOUT_S = 1.0
#: the longest (s), a week: far longer ones overflow the clocks of the waits it bounds
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(value: float) -> None:
    """The collective timeout's rule (`Deployment.timeout_s`): a number in
    [`MIN_TIMEOUT_S`, `MAX_TIMEOUT_S`]; `ValueError` naming ``timeout``."""
    if not (is_number(value) and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):  # NaN too
        raise ValueError(f"timeout must be at least {MIN_TIMEOUT_S:g} s (it also bounds "
                         f"joining the ranks) and at most {MAX_TIMEOUT_S:g} s, got {value!r}")


@dataclass(frozen=True)
class Budget:
    """Bytes one rank may use (None: not checked) and where the number comes from."""

    limit: int | None
    source: str


UNCHECKED = Budget(None, "not checked")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What a request runs on: the model, its layout and device, the limits admission
    checks a request against, and how the ranks run it. Built by
    `headmoe.deployment.build_deployment` (tests may build one directly)."""

    model_config: Magi2Config
    checkpoint: str = ""
    """The transformer's weights (`headmoe.release.components.resolve_model`, or the
    release's ``preview/`` index); "" where nothing runs (admission only)."""
    model: str = ""
    """The ``--model`` value (a server's request may name it when it is a preset)."""
    release: ReleaseFolder | None = None
    """The checked release folder (text encoder, decoders, refiner), or None for a bare
    checkpoint with the stand-in encoders of `headmoe.release.standins`."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    """Where the ranks run: "cpu" or "cuda"."""
    budget: Budget = UNCHECKED
    """The per-rank memory budget of admission's estimate."""
    count_tokens: Callable[[str], int] | None = None
    """The tokens the text encoder keeps of a text (None: the stand-in byte encoder's)."""
    describe: str = ""
    """How refusals name the model (e.g. "--model /ckpt (config magi2-preview)")."""
    offload: bool = False
    """``--offload``: the idle components' weights live on the host."""
    offload_layers: bool = False
    """Stream the transformer's layer weights from the checkpoint (``--offload-layers``,
    `headmoe.models.streaming`); the first ``resident_layers`` layers stay resident."""
    resident_layers: int = 0
    expert_format: str = DEFAULT_EXPERT_FORMAT
    """The routed experts' weight format every MoE layer registers (a name of
    `headmoe.moe.formats.EXPERT_FORMATS`: "bf16" the release's, "fp8" E4M3 with per-channel
    scales, quantized on load from a bf16 checkpoint or read from an FP8 one)."""
    refiner_config: Magi2RefinerConfig | None = None
    """The release's refiner (None: no refiner stage here)."""
    refiner_problem: str = ""
    """Why the release's refiner/ is not used (it failed its checks), for the refusal."""
    resident_refiner: bool = False
    """The refiner's weights stay on the device for every request (a server that loads
    ``refiner/`` at start), so a preview-only request counts them too."""
    dtype: str | None = None
    """The dtype every request runs in (a server's); None: each request's own."""
    threads: int = 1
    """torch threads per rank on a CPU (`set_rank_threads`'s count; the time estimate)."""
    max_time_s: float | None = None
    """``--max-time``: refuse a request whose time estimate is over it (None: no check)."""
    step_cache: str = ""
    """The measured step times' file (`headmoe.planner.time.STEP_TIMES_FILE` under the
    cache dir; "": the time estimate is the FLOP-rate one only)."""
    timeout_s: float = 300.0
    """Seconds any collective may wait (`check_timeout`)."""
    attention: str = "triton"
    """The MAGI-2 attention path the ranks run (`ATTENTION_PATHS`: the answer of
    `headmoe.layers.flash_attention.resolve_attention` to ``--attention``)."""
    cuda_graphs: bool = False
    """``--cuda-graphs``: capture the denoise step (`headmoe.layers.cuda_graphs`; refused
    by `check_cuda_graphs` where it cannot run); recorded in the sidecar's layout."""

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s)
        check_expert_format(self.expert_format)
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got "
                             f"{self.attention!r}")
        if self.offload_layers:
            split_layers(self.model_config.num_layers, self.resident_layers)
        elif self.resident_layers:
            raise ValueError(f"resident_layers={self.resident_layers!r} needs offload_layers")

    @property
    def recipe(self) -> Recipe:
        """The model's defaults (`headmoe.pipeline.recipe.recipe_for`)."""
        return recipe_for(self.model_config)

    @property
    def has_refiner(self) -> bool:
        """The release has ``refiner/``: a server loads it at start."""
        return self.release is not None and self.release.refiner is not None
