"""MAGI-2 transformer (headmoe.models.magi2): configs, packing, model, checkpoint loading."""

from headmoe.distributed.sharding import sp_token_counts
from headmoe.models.magi2.config import (
    MODALITIES,
    PRESETS,
    Magi2Config,
    config_from_arg,
    get_config,
    validate_parallel,
)
from headmoe.models.magi2.loading import (
    LoadReport,
    check_checkpoint,
    checkpoint_spec,
    load_checkpoint,
    parameter_count,
    spec_digest,
    write_random_checkpoint,
)
from headmoe.models.magi2.model import Magi2Transformer
from headmoe.models.magi2.packing import (
    BranchInput,
    BranchOutput,
    PackedInputs,
    modality_order,
    pack_branches,
    time_sinusoid,
    unpack_outputs,
)

__all__ = [
    "MODALITIES",
    "PRESETS",
    "BranchInput",
    "BranchOutput",
    "LoadReport",
    "Magi2Config",
    "Magi2Transformer",
    "PackedInputs",
    "check_checkpoint",
    "checkpoint_spec",
    "config_from_arg",
    "spec_digest",
    "get_config",
    "load_checkpoint",
    "modality_order",
    "pack_branches",
    "parameter_count",
    "sp_token_counts",
    "time_sinusoid",
    "unpack_outputs",
    "validate_parallel",
    "write_random_checkpoint",
]
