"""The ``hf`` converter of the ``hybrid`` family: ``Mamba2ForCausalLM`` (a pattern of ``M`` only),
through gpt's converter machinery (``mtl.models.convert_hf.HFConverter``) with the hybrid
architectures: tensors read and written one at a time, safetensors sharded past
``max_shard_bytes``."""

from __future__ import annotations

from mtl.models.convert_hf import HFArchitecture, HFConverter
from mtl.models.convert_hf import mamba2

ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        HFArchitecture("mamba2", mamba2.mamba2_model_section, mamba2.mamba2_to_mtl,
                       lambda section: (lambda name: False), mamba2.check_mamba2_exportable,
                       mamba2.mamba2_from_mtl, mamba2.mamba2_config),
    )
}


def hybrid_hf_converter() -> HFConverter:
    """Exports to Mamba2ForCausalLM unless told another architecture; no hybrid architecture here
    holds experts (a pattern with ``E`` is refused by the architecture's check)."""
    return HFConverter(ARCHITECTURES, moe_types=(), default=lambda model_config: "mamba2")
