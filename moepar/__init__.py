"""moepar: train Mixture-of-Experts language models with every parallelism in one engine."""

__version__ = "0.1.0"


def from_hf(path: str, **kwargs):
    """A Hugging Face MoE folder as a moepar model: forward(input_ids [B, T]) -> logits [B, T, V].

    See moepar.hf.from_hf (imported here lazily, so `import moepar` stays light).
    """
    from moepar.hf import from_hf as _from_hf
    return _from_hf(path, **kwargs)
