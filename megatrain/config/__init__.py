"""Every knob of a run and of a campaign, and how text becomes a validated config.

- ``section``  the base of every section: unknown keys are errors, assignments are validated
- ``model``    ``ModelConfig``: the model family as a choice of parts, kernels, RoPE scaling
- ``data``     ``DataConfig``: sources or a weighted mixture, tokenizer, sharding units and engine
- ``schema``   ``Config`` and its run sections (parallel, optim, train, checkpoint, ...)
- ``load``     YAML recipe + ``key.sub=value`` overrides -> ``Config``, or a ``ConfigError``
               naming the file, the field and the reason
- ``compat``   which config changes a checkpoint survives; the fingerprint of a run's math
- ``campaign`` a recipe trained through ordered stages; a campaign's folders on disk

The package imports neither torch nor prefect: the Prefect worker validates campaigns without
loading the engine. ``from megatrain.config import Config, load_config`` is the public API;
modules inside the package import each other directly.
"""

from megatrain.config.data import DataConfig, MixtureComponent
from megatrain.config.load import (
    ConfigError,
    format_validation_error,
    load_config,
    merge,
    parse_overrides,
    read_yaml,
)
from megatrain.config.model import CheckpointingPolicy, KernelConfig, ModelConfig, RopeScaling, YarnScaling
from megatrain.config.schema import (
    AnomalyConfig,
    CheckpointConfig,
    Config,
    FaultConfig,
    FP8Config,
    InitConfig,
    OptimConfig,
    OverlapConfig,
    ParallelConfig,
    ReliabilityConfig,
    SelfCheckConfig,
    TrainConfig,
)

__all__ = [
    "AnomalyConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FP8Config", "FaultConfig",
    "InitConfig", "KernelConfig", "MixtureComponent", "ModelConfig", "OptimConfig", "OverlapConfig", "ParallelConfig",
    "ReliabilityConfig", "RopeScaling", "YarnScaling", "CheckpointingPolicy", "SelfCheckConfig", "TrainConfig", "format_validation_error", "load_config",
    "merge", "parse_overrides", "read_yaml",
]
