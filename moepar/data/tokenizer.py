"""The tokenizer of `moepar data prepare`: a Hugging Face tokenizer.json (read with the `tokenizers`
library, no transformers) or moepar's byte tokenizer, and the EOS id that ends every document.

EOS is looked up in this order, the first hit wins:
  1. `--eos-token TOKEN` (a token of the vocabulary);
  2. `eos_token` in tokenizer_config.json beside tokenizer.json (what transformers uses);
  3. `eos_token_id` in generation_config.json or config.json beside it;
  4. the special token the post-processor appends to a single sequence (`$A </s>`);
  5. an added special token with a well-known EOS name (`</s>`, `<|endoftext|>`, ...).
None found is an error that asks for `--eos-token`.
"""

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from moepar.jsonfile import check_regular, parse_json, read_json

__all__ = ["TokenizerSpec", "resolve_tokenizer", "load_encoder", "BYTES", "BYTE_EOS_ID", "file_sha256"]

BYTES = "bytes"
# Bytes 0xF5..0xFF never occur in UTF-8, so 0xFF can end documents while the vocabulary stays 256.
BYTE_EOS_ID = 0xFF
BYTE_TOKENIZER_SHA256 = hashlib.sha256(b"moepar byte tokenizer v1: UTF-8 bytes 0..255, "
                                       b"EOS 255").hexdigest()
KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>")   # the last: DeepSeek-V3's


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer, and what the index records about it."""
    kind: str            # "bytes" or "tokenizer.json"
    path: str            # the tokenizer.json file; "" for bytes
    sha256: str          # of tokenizer.json's bytes (bytes: of a fixed description)
    vocab_size: int      # ids a model must embed: the largest id + 1
    eos_id: int
    eos_token: str
    eos_from: str        # where the EOS came from, for the summary line

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str) -> str:
    """The SHA-256 of a file, hex (how a tokenizer is identified in indexes and checkpoints)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_json(path: str) -> dict:
    data = read_json(path)      # FileError (a ValueError) naming the file
    return data if isinstance(data, dict) else {}


def _load_hf(path: str):
    from tokenizers import Tokenizer

    check_regular(path, "--tokenizer")      # a FIFO would block the reader
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:   # the Rust side raises plain Exception subclasses with a message
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json: {e}") from None
    # A tokenizer.json may carry truncation or padding meant for classification: documents here
    # must be tokenized whole and unpadded.
    tok.no_truncation()
    tok.no_padding()
    return tok


def _post_processor_eos(processor: dict | None) -> str | None:
    """The special token a post-processor appends after a single sequence, if any."""
    if not processor:
        return None
    kind = processor.get("type")
    if kind == "Sequence":
        for inner in reversed(processor.get("processors", [])):
            found = _post_processor_eos(inner)
            if found:
                return found
    if kind == "TemplateProcessing":
        single = processor.get("single") or []
        if single and "SpecialToken" in single[-1]:
            return single[-1]["SpecialToken"]["id"]
    if kind in ("RobertaProcessing", "BertProcessing"):
        return (processor.get("sep") or [None])[0]
    return None


def _find_eos(tok, folder: str) -> tuple[str, int, str]:
    """(token, id, where found) from the files beside tokenizer.json and the tokenizer itself."""
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        eos = _read_json(config).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos, tok.token_to_id(eos), "tokenizer_config.json"
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        eos_id = _read_json(path).get("eos_token_id") if os.path.isfile(path) else None
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int) and tok.id_to_token(eos_id) is not None:
            return tok.id_to_token(eos_id), eos_id, name
    spec = parse_json(tok.to_str(), f"{folder}: the tokenizer's own description")
    eos = _post_processor_eos(spec.get("post_processor"))
    if eos and tok.token_to_id(eos) is not None:
        return eos, tok.token_to_id(eos), "the post-processor's template"
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    for eos in KNOWN_EOS:
        if eos in special:
            return eos, tok.token_to_id(eos), "the added special tokens"
    return None, None, ""


def resolve_tokenizer(name: str, eos_token: str | None = None) -> TokenizerSpec:
    """`bytes`, a tokenizer.json, or a folder holding one; raises ValueError naming the problem."""
    if name == BYTES:
        if eos_token is not None:
            raise ValueError(f"--eos-token with --tokenizer bytes: the byte tokenizer's EOS is "
                             f"fixed at id {BYTE_EOS_ID} (0xFF, never a UTF-8 byte)")
        return TokenizerSpec(BYTES, "", BYTE_TOKENIZER_SHA256, 256, BYTE_EOS_ID, "<0xFF>", "fixed")
    path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        where = f"{name!r} is a folder without tokenizer.json" if os.path.isdir(name) else \
            f"{name!r} does not exist"
        raise ValueError(f"--tokenizer: {where}; give a Hugging Face tokenizer.json, a model "
                         f"folder holding one, or 'bytes'")
    tok = _load_hf(path)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if eos_token is not None:
        eos_id, found = tok.token_to_id(eos_token), "--eos-token"
        if eos_id is None:
            raise ValueError(f"--eos-token {eos_token!r} is not a token of {path}")
    else:
        eos_token, eos_id, found = _find_eos(tok, os.path.dirname(path))
        if eos_id is None:
            raise ValueError(f"{path}: no EOS token found (not in tokenizer_config.json, "
                             f"config.json, the post-processor, nor among the special tokens "
                             f"{', '.join(KNOWN_EOS[:3])}, ...); pass --eos-token TOKEN")
    return TokenizerSpec("tokenizer.json", os.path.abspath(path), file_sha256(path), vocab_size,
                         eos_id, eos_token, found)


def load_encoder(spec: TokenizerSpec):
    """texts -> one id array per text (no special tokens added), in spec.dtype."""
    dtype = np.dtype(spec.dtype)
    if spec.kind == BYTES:
        return lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype)
                              for t in texts]
    tok = _load_hf(spec.path)
    return lambda texts: [np.array(e.ids, dtype=dtype)
                          for e in tok.encode_batch(texts, add_special_tokens=False)]
