"""The ``hybrid`` model family: Mamba-2, attention, MLP and MoE layers stacked by a pattern
(``model.hybrid_pattern``, Megatron's hybrid model and NVIDIA's Nemotron-H)."""
