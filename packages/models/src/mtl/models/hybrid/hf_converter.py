"""The ``hf`` converter of the ``hybrid`` family: ``Mamba2ForCausalLM`` (a pattern of ``M`` only) and
``NemotronHForCausalLM`` (Mamba-2, attention, MLP and MoE layers),
through gpt's converter machinery (``mtl.models.convert_hf.HFConverter``) with the hybrid
architectures: tensors read and written one at a time, safetensors sharded past
``max_shard_bytes``."""

from __future__ import annotations

from mtl.models.convert_hf import HFArchitecture, HFConverter
from mtl.models.convert_hf import mamba2, nemotron_h

ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        HFArchitecture("mamba2", mamba2.mamba2_model_section, mamba2.mamba2_to_mtl,
                       lambda section: (lambda name: False), mamba2.check_mamba2_exportable,
                       mamba2.mamba2_from_mtl, mamba2.mamba2_config),
        HFArchitecture("nemotron_h", nemotron_h.nemotron_h_model_section, nemotron_h.nemotron_h_to_mtl,
                       lambda section: (lambda name: False), nemotron_h.check_nemotron_h_exportable,
                       nemotron_h.nemotron_h_from_mtl, nemotron_h.nemotron_h_config),
    )
}


def default_architecture(m) -> str:
    """A pattern of Mamba-2 layers alone exports as Mamba2ForCausalLM, any other as Nemotron-H."""
    return "mamba2" if set(m.hybrid_pattern.replace("|", "")) == {"M"} else "nemotron_h"


def hybrid_hf_converter() -> HFConverter:
    """Nemotron-H alone holds experts (``E`` layers)."""
    return HFConverter(ARCHITECTURES, moe_types=("nemotron_h",), default=default_architecture)
