"""Inference: runs, checkpoints and Hugging Face folders as models that generate text, and the
validation loss.

    source.py     what a SOURCE is (run, checkpoint, HF folder): weights, config, tokenizer
    generate.py   decoding with a KV cache (greedy, temperature, top-p, EOS); `moepar generate`
    evaluate.py   validation loss and perplexity, in training and as `moepar eval`
"""

from .generate import LanguageModel, from_hf, generate, load
from .source import SourceError

__all__ = ["LanguageModel", "generate", "load", "from_hf", "SourceError"]
