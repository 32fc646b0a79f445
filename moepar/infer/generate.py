"""`moepar generate` and `model.generate`: decoding with a KV cache, greedy or sampled.

    moepar generate SOURCE --prompt "..." [--max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 0]

SOURCE is a run directory, a checkpoint or a Hugging Face folder (source.py). The prompt runs
through the model once (the prefill, which fills the KV cache: layers/cache.py), then each new
token is one call on one position. Temperature 0 is greedy (argmax; ties go to the lowest id, as
in transformers); otherwise the logits are divided by the temperature, cut to the smallest set of
most likely tokens whose probability reaches top_p (nucleus sampling), and sampled from a
generator seeded by `seed`: the same seed gives the same text on the same device.

MoE layers at decode time: every model call is its own capacity group. Capacity drops depend on
all tokens of a group, later ones included, so a token decoded alone cannot be dropped as it
would be in a forward of the whole sequence; models loaded for inference (`moepar.load`,
`moepar.from_hf`, this command) therefore route without a capacity limit (source.dropless), and
decoding with the cache gives the logits of a full forward of the same dropless model.
"""

import argparse
import sys
import time

import torch

from moepar.hf import from_hf as convert

from .source import Source, SourceError, build_model, load_tokenizer, resolve_source

__all__ = ["generate", "next_token", "sampling_probs", "LanguageModel", "load", "from_hf", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def sampling_probs(logits_BV, temperature: float, top_p: float):
    """The distribution tokens are drawn from: softmax(logits / temperature), cut to the smallest
    set of most likely tokens whose probability reaches top_p (not renormalised)."""
    wide = logits_BV.to(torch.promote_types(logits_BV.dtype, torch.float32))
    probs_BV = torch.softmax(wide / temperature, dim=-1)
    if top_p >= 1:
        return probs_BV
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    better_BV = sorted_BV.cumsum(-1) - sorted_BV    # the mass of the likelier tokens
    # A token stays while the likelier ones hold less than top_p (the first always does).
    sorted_BV = sorted_BV.masked_fill(better_BV >= top_p, 0.0)
    return torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)


def next_token(logits_BV, temperature: float, top_p: float, generator=None):
    """The next token of each row: argmax when temperature is 0, else drawn from
    `sampling_probs` with `generator`."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = sampling_probs(logits_BV, temperature, top_p)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def _check(model, input_ids, max_new_tokens: int, temperature: float, top_p: float):
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, tokens] with at least one token, got shape "
                         f"{tuple(input_ids.shape)} (or a list of prompts of several lengths)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    limit, total = model.cfg.max_seq_len, input_ids.shape[1] + max_new_tokens
    if total > limit:
        raise ValueError(f"{input_ids.shape[1]} prompt tokens + {max_new_tokens} new tokens = "
                         f"{total} exceed model.max_seq_len={limit}")
    vocab = model.cfg.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids hold ids outside [0, model.vocab_size={vocab})")


def _left_padded(prompts, device):
    """Prompts of several lengths as one [B, T] batch padded on the left, and its documents
    (-1 on the padding, 0 on each prompt: layers/documents.py)."""
    rows = [torch.as_tensor(p, device=device).reshape(-1) for p in prompts]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    documents = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = row
        documents[b, width - len(row):] = 0
    return input_ids, documents, [len(r) for r in rows]


@torch.no_grad()
def generate(model, input_ids, max_new_tokens: int = 64, temperature: float = 0.8,
             top_p: float = 0.95, seed: int = 0, eos_ids=()):
    """Continues each row of `input_ids` [B, T] (a moepar Transformer); returns [B, T + n],
    n <= max_new_tokens. With `eos_ids`, a row ends at its first EOS (later positions repeat
    eos_ids[0], as transformers pads them) and decoding stops once every row has ended.
    MoE layers route as `model` was built, each call one capacity group (see the module
    docstring; `load` and `from_hf` build them dropless). `input_ids` may also be a list of
    prompts of several lengths: they run as one batch padded on the left, the padding masked
    as packed training masks it (attention, RoPE positions from 0 at each prompt, routers), and
    a list of rows comes back, each its prompt and new tokens, as if it ran alone."""
    device = model.embed.weight.device
    documents, lengths = None, None
    ragged = isinstance(input_ids, (list, tuple)) and all(
        isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids)     # (not one flat row)
    if ragged and len({len(p) for p in input_ids}) > 1:
        input_ids, documents, lengths = _left_padded(input_ids, device)
    input_ids = torch.as_tensor(input_ids, device=device)
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    _check(model, input_ids, max_new_tokens, temperature, top_p)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    eos = torch.tensor(list(eos_ids), dtype=input_ids.dtype, device=device)
    cache = model.new_cache(input_ids.shape[1] + max_new_tokens)
    packed = {} if documents is None else {"documents": documents}
    logits_BV = model(input_ids, cache=cache, logits_to_keep=1, **packed)[0][:, -1]
    done_B = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    new = []
    for i in range(max_new_tokens):
        token_B = next_token(logits_BV, temperature, top_p, generator)
        if eos.numel():
            token_B = torch.where(done_B, eos[0], token_B)
            done_B |= torch.isin(token_B, eos)
        new.append(token_B)
        # One host sync per token, only when there is an EOS to stop at.
        if i + 1 == max_new_tokens or (eos.numel() and bool(done_B.all())):
            break
        if documents is not None:     # each new token belongs to its row's prompt
            documents = torch.cat([documents, documents[:, -1:]], dim=1)
            packed = {"documents": documents}
        logits_BV = model(token_B[:, None], cache=cache, **packed)[0][:, -1]
    out = torch.cat([input_ids, *(t[:, None] for t in new)], dim=1)
    if lengths is None:
        return out
    return [row[input_ids.shape[1] - n:] for row, n in zip(out, lengths, strict=True)]


class LanguageModel(torch.nn.Module):
    """A moepar Transformer for inference: forward(input_ids [B, T]) -> logits [B, T, V],
    `generate(input_ids, ...)`, and with a tokenizer `complete(prompt, ...)` -> text."""

    def __init__(self, model, tokenizer=None, tokenizer_error: str = ""):
        super().__init__()
        self.model, self.tokenizer, self._tokenizer_error = model, tokenizer, tokenizer_error

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_ids if self.tokenizer is not None else ()

    def forward(self, input_ids):
        return self.model(input_ids)[0]

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.8,
                 top_p: float = 0.95, seed: int = 0, eos_ids=None):
        """See `generate`; `eos_ids` default to the tokenizer's (none without one)."""
        return generate(self.model, input_ids, max_new_tokens, temperature, top_p, seed,
                        self.eos_ids if eos_ids is None else eos_ids)

    def complete(self, prompt: str, **kwargs) -> str:
        """The text generated after `prompt` (keywords as for `generate`)."""
        if self.tokenizer is None:
            raise ValueError(f"this model has no tokenizer ({self._tokenizer_error}); pass "
                             "token ids to generate(), or load it with tokenizer=...")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it encodes to no tokens")
        out = self.generate(torch.tensor([ids]), **kwargs)
        return self.tokenizer.continuation(ids, out[0, len(ids):].tolist())


def load(source: str, dtype=torch.float32, device="cpu", tokenizer: str | None = None,
         log=print) -> LanguageModel:
    """A run directory (its newest checkpoint), a checkpoint or a Hugging Face folder as a
    LanguageModel on `device`, with the tokenizer of its data when one is known (`tokenizer`:
    'bytes', a tokenizer.json or a folder holding one, to choose it)."""
    resolved = resolve_source(source)
    return _with_tokenizer(build_model(resolved, dtype, device, log), resolved, tokenizer)


def from_hf(path: str, tokenizer: str | None = None, **kwargs) -> LanguageModel:
    """A Hugging Face folder as a LanguageModel (keywords as for moepar.hf.from_hf: dtype, log),
    with the folder's tokenizer.json when it has one."""
    return _with_tokenizer(convert(path, **kwargs).model, Source("hf", path, path, None),
                           tokenizer)


def _with_tokenizer(model, source: Source, tokenizer: str | None) -> LanguageModel:
    try:
        return LanguageModel(model, load_tokenizer(source, tokenizer))
    except SourceError as e:
        if tokenizer:       # asked for by name: its problem is the caller's
            raise
        return LanguageModel(model, None, str(e))


# ---- the command ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moepar generate", description="Continue a prompt with a trained or converted model "
        "(KV-cache decoding on one process).")
    parser.add_argument("source", help="a run directory (its newest checkpoint), a checkpoint "
                                       "directory, or a Hugging Face model folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="stop after N new tokens, or at the tokenizer's EOS (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="divide the logits by T before sampling; 0: greedy (default 0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, metavar="P",
                        help="sample from the smallest set of tokens holding P of the "
                             "probability (default 0.95; 1: all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the sampler: the same seed, the same text (default 0)")
    parser.add_argument("--tokenizer", metavar="TOKENIZER",
                        help="'bytes', a tokenizer.json, or a folder holding one (default: the "
                             "one the weights were trained with)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="always generate --max-new-tokens tokens")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)   # noqa: E731
    try:
        source = resolve_source(args.source)
        tokenizer = load_tokenizer(source, args.tokenizer)
        lm = LanguageModel(build_model(source, DTYPES[args.dtype], device, log), tokenizer)
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ValueError("--prompt is empty: it encodes to no tokens")
        start = time.perf_counter()
        out = lm.generate(torch.tensor([ids]), args.max_new_tokens, args.temperature,
                          args.top_p, args.seed, eos_ids=() if args.ignore_eos else None)
        seconds = time.perf_counter() - start
    except (ValueError, OSError) as e:       # SourceError and CheckpointError are ValueErrors
        print(f"moepar generate: error: {e}", file=sys.stderr)
        return 1
    new = out[0, len(ids):].tolist()
    print(args.prompt + tokenizer.continuation(ids, new), flush=True)
    log(f"{source.kind} {source.weights}; tokenizer {tokenizer.name}; {len(ids)} prompt + "
        f"{len(new)} new tokens in {seconds:.2f} s on {device}")
    return 0
