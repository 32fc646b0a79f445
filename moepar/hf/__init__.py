"""Hugging Face checkpoints in and out (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3).

`convert.py` streams tensors between HF folders and moepar checkpoints; `arch.py` maps each
architecture's config.json fields and tensor names; `cli.py` is `moepar convert`.
"""

from .arch import ARCHS, ConversionError
from .convert import CausalLM, from_hf, hf_to_moepar, moepar_to_hf

__all__ = ["ARCHS", "ConversionError", "hf_to_moepar", "moepar_to_hf", "from_hf", "CausalLM"]
