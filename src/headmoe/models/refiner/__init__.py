"""The MAGI-2 1080p refiner (headmoe.models.refiner): config, packing, model, loading."""

from headmoe.models.refiner.config import (
    PRESETS,
    Magi2RefinerConfig,
    get_refiner_config,
    validate_parallel,
)
from headmoe.models.refiner.loading import (
    check_refiner_checkpoint,
    load_refiner,
    refiner_parameter_count,
    refiner_spec,
    refiner_weight_bytes,
    write_random_refiner,
)
from headmoe.models.refiner.model import MLP_CHUNK_ROWS, Magi2Refiner
from headmoe.models.refiner.packing import (
    BlockGrid,
    RefinerPacked,
    attention_plan,
    pack_refiner,
    unpack_video,
)

__all__ = [
    "MLP_CHUNK_ROWS",
    "PRESETS",
    "BlockGrid",
    "Magi2Refiner",
    "Magi2RefinerConfig",
    "RefinerPacked",
    "attention_plan",
    "check_refiner_checkpoint",
    "get_refiner_config",
    "load_refiner",
    "pack_refiner",
    "refiner_parameter_count",
    "refiner_spec",
    "refiner_weight_bytes",
    "unpack_video",
    "validate_parallel",
    "write_random_refiner",
]
