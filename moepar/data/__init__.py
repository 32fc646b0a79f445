"""Token data: what training reads (sources, blends, the sampler, validation batches, the dataset
fingerprint) and `moepar data prepare`, which writes tokenized folders.

    tokens.py     byte tokenizer, one-array sources, WindowSampler
    documents.py  document boundaries of a folder; packed windows (data.pack, data.pad)
    packing.py    PackedSampler: micro-batches of packed windows with document numbers
    folder.py     reading a prepared folder: index, shards checked then memory-mapped
    sources.py    [data] -> sources, blend, fingerprint, validation batches; build_sampler
    tokenizer.py  tokenizer.json / bytes, and the EOS id
    prepare.py    inputs -> worker processes -> shards + index, atomically
    cli.py        `moepar data prepare ...`

Names are imported on first use, so `moepar data prepare` and its workers never load torch.
"""

import importlib

# name -> the module defining it
_EXPORTS = {
    "ByteTokenizer": "tokens", "load_tokens": "tokens", "check_token_range": "tokens",
    "WindowSampler": "tokens", "BlendedSampler": "sources", "build_sampler": "sources",
    "fingerprint": "sources", "check_same_dataset": "sources", "validation_batches": "sources",
    "PreparedFolder": "folder", "ShardedTokens": "folder", "PackedSampler": "packing",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moepar.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moepar.data.{_EXPORTS[name]}"), name)
