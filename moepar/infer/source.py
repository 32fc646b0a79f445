"""What a SOURCE of `moepar generate` / `moepar eval` / `moepar.load` is, and its tokenizer.

| SOURCE                                   | weights                    | model config          |
|------------------------------------------|----------------------------|-----------------------|
| a run directory (run.dir)                | its newest checkpoint      | that checkpoint's     |
| a checkpoint (checkpoints/step_N, or the | that directory             | state.json            |
|   output of `moepar convert --to moepar`) |                            |                       |
| a Hugging Face folder (config.json +     | its safetensors            | config.json           |
|   model.safetensors[.index.json])        |                            |                       |

The tokenizer follows the data the weights learned from:

| the weights came from                        | tokenizer                                            |
|----------------------------------------------|------------------------------------------------------|
| data.source builtin or text                  | bytes (vocabulary 256), no EOS                       |
| a prepared folder (data.source tokens)       | the folder's tokenizer.json (bytes when prepared     |
|                                              | with --tokenizer bytes), EOS from its index.json     |
| a HF folder, or a converted checkpoint with  | that tokenizer.json; EOS as `moepar data prepare`    |
|   the tokenizer files beside the weights     | finds it, plus generation_config.json's eos ids      |

`--tokenizer` (or `tokenizer=`) overrides it; a source without one can still take token ids.
"""

import dataclasses
import os
from dataclasses import dataclass

import torch

from moepar.checkpoint import MANIFEST, latest_checkpoint, load_checkpoint, read_state
from moepar.config import model_sections
from moepar.data.folder import PreparedFolder, is_prepared
from moepar.data.tokenizer import BYTE_EOS_ID, BYTE_TOKENIZER_SHA256, resolve_tokenizer
from moepar.fits import check_fits
from moepar.hf import from_hf
from moepar.jsonfile import Obj, check_regular, read_json
from moepar.layers import Transformer
from moepar.layers.init import reset_rope_buffers
from moepar.layers.shapes import param_count

__all__ = ["SourceError", "Source", "resolve_source", "Tokenizer", "load_tokenizer",
           "build_model", "dropless"]


class SourceError(ValueError):
    """A SOURCE that is not a run, a checkpoint or a HF folder, or lacks what is asked of it."""


@dataclass
class Source:
    kind: str              # "run", "checkpoint" or "hf"
    path: str              # as given
    weights: str           # the checkpoint directory, or the HF folder
    config: dict | None    # the run config of the checkpoint (state.json); None for HF folders

    @property
    def run_dir(self) -> str | None:
        """The run directory holding the checkpoint (run/checkpoints/step_N), if any."""
        if self.kind == "run":
            return self.path
        parent = os.path.dirname(os.path.abspath(self.weights))
        return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def is_hf_folder(path: str) -> bool:
    return os.path.lexists(os.path.join(path, "config.json")) and any(   # readers check them
        os.path.lexists(os.path.join(path, f))
        for f in ("model.safetensors", "model.safetensors.index.json"))


def resolve_source(path: str) -> Source:
    """Which kind of SOURCE `path` is; raises SourceError naming what was looked for."""
    if not os.path.isdir(path):
        raise SourceError(f"{path!r} is not a directory: give a run directory, a checkpoint "
                          "directory or a Hugging Face model folder")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return Source("checkpoint", path, path, _state_config(path))
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
            os.path.join(path, "config.toml")):
        ckpt = latest_checkpoint(os.path.join(path, "checkpoints"))
        if ckpt is None:
            raise SourceError(f"run {path!r} has no complete checkpoint in {path}/checkpoints "
                              "yet (a checkpoint is written every run.checkpoint_every steps "
                              "and at the last step)")
        return Source("run", path, ckpt, _state_config(ckpt))
    if is_hf_folder(path):
        return Source("hf", path, path, None)
    raise SourceError(f"{path!r} is not a run directory (config.toml, checkpoints/), a checkpoint "
                      f"({MANIFEST}) or a Hugging Face folder (config.json with model.safetensors)")


def _state_config(ckpt: str) -> dict:
    config = read_state(ckpt).get("config")
    if not isinstance(config, dict) or "model" not in config:
        raise SourceError(f"checkpoint {ckpt!r}: state.json has no model config")
    return config


def dropless(router_cfg):
    """The router settings for inference: top-k routing without a capacity limit. Capacity drops
    depend on every token of the group, later ones included, so a model that decodes token by
    token cannot reproduce them; every token goes to its top-k experts instead (as Hugging Face's
    MoE models do)."""
    if router_cfg.type != "topk":
        raise SourceError(f"router.type={router_cfg.type!r}: expert-choice routing picks tokens "
                          "among the whole group, so a model cannot decode with it one token at "
                          "a time; generation needs router.type='topk'")
    return dataclasses.replace(router_cfg, capacity_factor=None)


def build_model(source: Source, dtype=torch.float32, device="cpu", log=print):
    """The source's Transformer, weights loaded, in eval mode, with dropless routing."""
    if source.kind == "hf":
        return from_hf(source.weights, dtype=dtype, log=log).model.to(device)  # routing: dropless
    try:
        model_cfg, router_cfg = model_sections(source.config, f"{source.weights}/state.json")
    except ValueError as e:
        raise SourceError(f"checkpoint {source.weights!r}: its model config does not fit this "
                          f"moepar ({e})") from None
    router_cfg = dropless(router_cfg)
    element = torch.empty((), dtype=dtype).element_size()
    check_fits(param_count(model_cfg)["total"] * element, device,
               f"the model of {source.weights} ({str(dtype).removeprefix('torch.')} weights)")
    with torch.device("meta"):      # every tensor comes from the checkpoint
        model = Transformer(model_cfg, router_cfg, seed=0)
    model = model.to(dtype).to_empty(device=device)
    reset_rope_buffers(model, model_cfg)
    load_checkpoint(source.weights, model, restore_rng=False)
    return model.eval()


# ---- tokenizers -------------------------------------------------------------------------------

class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text; `eos_ids` end a generation."""

    def __init__(self, name: str, eos_ids: tuple[int, ...], hf=None, special: bool = False):
        self.name, self.eos_ids, self.hf, self.special = name, eos_ids, hf, special

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        # HF folders: special tokens (a BOS) as transformers' tokenizer adds them; prepared
        # folders: none, as `moepar data prepare` tokenized the training text.
        return self.hf.encode(text, add_special_tokens=self.special).ids

    def continuation(self, prompt_ids, new_ids) -> str:
        """The text `new_ids` add after the prompt: decoded together with the prompt, so that a
        tokenizer that drops a word's leading space at the start of a text keeps it here."""
        prompt = self.decode(prompt_ids)
        whole = self.decode(list(prompt_ids) + list(new_ids))
        return whole[len(prompt):] if whole.startswith(prompt) else self.decode(new_ids)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) not in self.eos_ids]
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=True)


def _bytes(eos: bool) -> Tokenizer:
    return Tokenizer("bytes", (BYTE_EOS_ID,) if eos else ())


def _hf_tokenizer(folder_or_file: str, eos_ids: tuple[int, ...] | None, special: bool) -> Tokenizer:
    """A tokenizer.json through the `tokenizers` library; EOS ids given, or found as `moepar data
    prepare` finds them (plus generation_config.json's list)."""
    from tokenizers import Tokenizer as HFTokenizer

    spec = resolve_tokenizer(folder_or_file) if eos_ids is None else None
    path = spec.path if spec else folder_or_file
    check_regular(path, "tokenizer")       # a FIFO would block the reader
    tok = HFTokenizer.from_file(path)
    tok.no_truncation()
    tok.no_padding()
    if eos_ids is None:
        eos_ids = (spec.eos_id,) + _generation_eos(os.path.dirname(path))
    return Tokenizer(path, tuple(dict.fromkeys(eos_ids)), tok, special)


def _generation_eos(folder: str) -> tuple[int, ...]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.lexists(path):
        return ()
    ids = read_json(path, Obj({}), "generation config").get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids]
    return tuple(i for i in ids if isinstance(i, int))


def _data_tokenizer(data: dict, where: str) -> Tokenizer:
    """The tokenizer of the data a run trained on (its [data] section)."""
    source = data.get("source", "builtin")
    if source in ("builtin", "text"):
        return _bytes(eos=False)
    path = data.get("path") or (data.get("paths") or [""])[0]
    if not is_prepared(path):
        raise SourceError(f"{where} trained on data.path={path!r}, which is not (or no longer) a "
                          "folder from `moepar data prepare`, so its tokenizer is unknown; pass "
                          "--tokenizer (a tokenizer.json, a folder holding one, or 'bytes')")
    folder = PreparedFolder(path, "data.path")
    if folder.tokenizer_sha256 == BYTE_TOKENIZER_SHA256:
        return _bytes(eos=True)
    return _hf_tokenizer(os.path.join(path, "tokenizer.json"), (folder.eos_id,), special=False)


def load_tokenizer(source: Source, override: str | None = None) -> Tokenizer:
    """The tokenizer for `source` (see the module docstring); `override`: 'bytes', a
    tokenizer.json or a folder holding one. Raises SourceError when none is known."""
    if override:
        return _bytes(eos=True) if override == "bytes" else _hf_tokenizer(override, None, True)
    if os.path.isfile(os.path.join(source.weights, "tokenizer.json")):
        return _hf_tokenizer(source.weights, None, special=True)
    if source.kind == "hf":
        raise SourceError(f"{source.path!r} has no tokenizer.json; pass --tokenizer FILE (a "
                          "tokenizer.json or a folder holding one), or --tokenizer bytes for a "
                          "byte-level model (vocabulary 256, a token per byte: what moepar "
                          "exports of a run on its builtin or text data)")
    data = source.config.get("data")
    if data is None:
        raise SourceError(f"checkpoint {source.weights!r} records no training data and holds no "
                          "tokenizer.json; pass --tokenizer FILE (a tokenizer.json or a folder "
                          "holding one), or --tokenizer bytes for a byte-level model")
    return _data_tokenizer(data, f"checkpoint {source.weights!r}")
