"""The run configuration: ``RunConfig``, one dataclass per section, resolved in two passes.

``RunConfig.resolve`` returns a copy in which every derived value is computed once
(``config_derive``) and then every constraint is checked (``config_checks``), before any work;
modules receive the resolved config and never re-derive anything. The files:

- ``config_sections``: the section dataclasses, their defaults and their documentation;
- ``config_values``: a section built from a table of values, with its types checked;
- ``config_derive`` / ``config_checks`` + ``config_feature_checks``: the two passes;
- ``config_pipeline``: the layers of each pipeline stage;
- ``config_io``: TOML files, ``--set`` overrides, diffs; ``config_removed``: keys mtl dropped;
- ``device_probe``: whether a run uses CUDA, asked of torch where a default depends on it.

The names other packages use are importable from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mtl.core.config_checks import check, check_values
from mtl.core.config_derive import derive
from mtl.core.config_pipeline import (  # noqa: F401 (importable from here)
    derive_flops_split,
    layer_and_head_flops,
    pipeline_layer_split,
    pipeline_num_layers,
    pipeline_rank_layers,
)
from mtl.core.config_sections import (  # noqa: F401 (importable from here)
    CHOICES,
    SECTIONS,
    CkptConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from mtl.core.config_values import section_from_dict


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resolved: bool = False

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def resolve(self, world_size: int = 1, tokenizer_vocab_size: int | None = None) -> "RunConfig":
        """A copy with every derived value filled in and every constraint checked."""
        # rebuilt from its values, so a section built in code has its types checked as a file's are
        cfg = RunConfig(**{name: section_from_dict(name, values) for name, values in self.to_dict().items()})
        check_values(cfg)  # what the derivations divide by and choose from
        derive(cfg, world_size, tokenizer_vocab_size)
        check(cfg, tokenizer_vocab_size)
        cfg.resolved = True
        # last: the model family counts the FLOPs of a resolved config only
        derive_flops_split(cfg)
        return cfg
