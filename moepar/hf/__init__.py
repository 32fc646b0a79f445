"""Hugging Face checkpoints in and out (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3).

`convert.py` streams tensors between HF folders and moepar checkpoints; `arch.py` maps each
architecture's config.json fields, `names.py` its tensor names; `fp8.py` dequantizes FP8
block-quantized weights on import; `cli.py` is `moepar convert`.
"""

from .arch import ARCHS, ConversionError
from .convert import CausalLM, from_hf, hf_to_moepar, moepar_to_hf

__all__ = ["ARCHS", "ConversionError", "hf_to_moepar", "moepar_to_hf", "from_hf", "CausalLM"]
