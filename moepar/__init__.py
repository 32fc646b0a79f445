"""moepar: train Mixture-of-Experts language models with every parallelism in one engine."""

__version__ = "0.1.0"
