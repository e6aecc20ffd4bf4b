"""MAGI-2 transformer (headmoe.models.magi2): configs, model, checkpoint loading."""

from headmoe.models.magi2.config import (
    MODALITIES,
    PRESETS,
    Magi2Config,
    get_config,
    validate_parallel,
)
from headmoe.models.magi2.loading import (
    checkpoint_spec,
    load_checkpoint,
    write_random_checkpoint,
)
from headmoe.models.magi2.model import (
    BranchInput,
    BranchOutput,
    Magi2Transformer,
    sp_token_counts,
)

__all__ = [
    "MODALITIES",
    "PRESETS",
    "BranchInput",
    "BranchOutput",
    "Magi2Config",
    "Magi2Transformer",
    "checkpoint_spec",
    "get_config",
    "load_checkpoint",
    "sp_token_counts",
    "validate_parallel",
    "write_random_checkpoint",
]
