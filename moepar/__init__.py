"""moepar: train Mixture-of-Experts language models with every parallelism in one engine."""

__version__ = "0.1.0"


def from_hf(path: str, **kwargs):
    """A Hugging Face MoE folder as a moepar model: forward(input_ids [B, T]) -> logits [B, T, V],
    `.generate(input_ids, ...)`, and `.complete(prompt)` when the folder holds a tokenizer.json.

    See moepar.infer.generate.from_hf (imported here lazily, so `import moepar` stays light).
    """
    from moepar.infer.generate import from_hf as _from_hf
    return _from_hf(path, **kwargs)


def load(source: str, **kwargs):
    """A run directory (its newest checkpoint), a checkpoint or a Hugging Face folder as a model
    with `.generate` (and `.complete` with its tokenizer); see moepar.infer.generate.load."""
    from moepar.infer.generate import load as _load
    return _load(source, **kwargs)
