"""`moepar data prepare --train-tokenizer VOCAB`: a byte-level BPE trained with Hugging Face
`tokenizers` on the documents of the training split only, so the validation split never shapes
the vocabulary its loss is measured in.

The tokenizer is GPT-2's kind (what `tokenizers.ByteLevelBPETokenizer` builds): text is split by
the byte-level pre-tokenizer, every byte is in the initial alphabet (no unknown tokens, any UTF-8
round-trips), merges are learned up to VOCAB tokens, and `<|endoftext|>` is its one special
token, the EOS that ends every document. Written as tokenizer.json, which `moepar generate`,
`moepar.load` and transformers' `PreTrainedTokenizerFast` read.
"""

__all__ = ["EOS_TOKEN", "train_bpe"]

EOS_TOKEN = "<|endoftext|>"


def train_bpe(documents, vocab_size: int, path: str):
    """Trains on the iterable of document texts and saves tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents, trainer)
    tok.save(path)
