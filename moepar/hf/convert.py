"""Hugging Face checkpoints in and out: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3
(config fields in arch.py, tensor names in names.py, FP8 dequantization in fp8.py).

    moepar convert --from hf SRC_DIR --to moepar DST_DIR
    moepar convert --from moepar SRC_DIR --to hf DST_DIR [--arch NAME]
    moepar.from_hf(path) -> a model whose forward(input_ids [B, T]) returns logits [B, T, V]

Conversion streams: one source shard is read at a time, and a tensor is held only until its
partner arrives (an expert's gate and up projections become one `w_in`), so two full copies of
the model never sit in memory. FP8 block-quantized weights (DeepSeek-V3) are dequantized as they
stream in; DeepSeek-V3's multi-token-prediction layers become model.mtp_layers (names.py), other
architectures' are dropped with a note. Every (layer, expert) tensor
must appear exactly once; a missing, extra or mis-shaped tensor is an error that names it. A
moepar checkpoint made here is the same format the trainer writes (layout-free names, index, manifest), plus `config.toml` (a run config
with the model and router sections) and `hf_config.json` (the source's config, written back on
export so a round trip returns the same config.json; less quantization_config and the MTP
layers when the import removed those).
"""

import dataclasses
import json
import math
import os
import secrets
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moepar.checkpoint import canonical_names, commit, read_canonical, read_state, verify_checkpoint
from moepar.config import model_sections, sections_toml
from moepar.data.tokenizer import BYTE_TOKENIZER_SHA256, file_sha256
from moepar.filemode import follow_umask
from moepar.fits import available_bytes
from moepar.hf.arch import (ARCHS, ConversionError, arch_by_name, export_notes, hf_config_dict,
                            load_config_json, load_hf_json, matching_archs, mtp_layers,
                            read_hf_config, router_loss_fields)
from moepar.hf.fp8 import dequantized, quantization_block
from moepar.hf.names import (canonical_to_hf, expected_canonical, hf_to_canonical, layer_index,
                             rope_interleaved)
from moepar.jsonfile import FileError, Map, Obj, Str, read_json
from moepar.layers import Transformer
from moepar.layers.experts import GroupedExperts
from moepar.layers.init import reset_rope_buffers
from moepar.layers.model import ModelConfig
from moepar.layers.shapes import param_count
from moepar.tensorfile import TensorFileError, read_header

__all__ = ["ARCHS", "ConversionError", "hf_to_moepar", "moepar_to_hf", "from_hf", "CausalLM"]


# ---- files ------------------------------------------------------------------------------------

def _shard_name(path: str, file) -> str:
    """An index entry's file, refused unless it is a plain relative path inside `path`."""
    if (not isinstance(file, str) or not file or os.path.isabs(file) or "\\" in file
            or any(part in ("", ".", "..") for part in file.split("/"))):
        raise ConversionError(f"{path!r}: model.safetensors.index.json names the file {file!r}, "
                              "which is not a file inside the folder")
    return file


_INDEX_SCHEMA = Obj({"weight_map": Map(Str())}, required=("weight_map",))


def source_files(path: str) -> list[tuple[str, dict]]:
    """[(shard file, its validated header {name: dtype, shape, data_offsets})] of a HF folder,
    checked against the index (every listed tensor where the index says, nothing unlisted)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        try:
            weight_map = read_json(index, _INDEX_SCHEMA)["weight_map"]
        except FileError as e:
            raise ConversionError(f"{e} (not a valid safetensors index)") from None
        weight_map = {name: _shard_name(path, file) for name, file in weight_map.items()}
        files = sorted(set(weight_map.values()))
    elif os.path.lexists(os.path.join(path, "model.safetensors")):   # read_header checks it
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ConversionError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
    out = []
    for file in files:
        try:
            header, _ = read_header(os.path.join(path, file))
        except TensorFileError as e:
            raise ConversionError(f"{path!r}: {e}") from None
        if weight_map is not None:
            listed = {n for n, f in weight_map.items() if f == file}
            if listed - set(header):
                raise ConversionError(f"{path!r}: the index puts {sorted(listed - set(header))[:4]} "
                                      f"in {file}, which does not hold them")
            if set(header) - listed:
                raise ConversionError(f"{path!r}: {file} holds {sorted(set(header) - listed)[:4]}, "
                                      "which the index puts elsewhere or does not list")
        out.append((file, header))
    return out


def hf_tensors(path: str, files: list | None = None):
    """Streams (name, tensor) from a HF folder, one shard file open at a time; every header is
    validated first (source_files), so a damaged or hostile file is a ConversionError."""
    seen = set()
    for file, header in (source_files(path) if files is None else files):
        try:
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for name in header:
                    if name in seen:
                        raise ConversionError(f"tensor {name!r} appears in more than one shard")
                    seen.add(name)
                    yield name, _finite(f.get_tensor(name), name, file)
        except ConversionError:
            raise
        except Exception as e:    # the safetensors reader's own refusals (SafetensorError)
            raise ConversionError(f"{path!r}: {file} cannot be read ({e})") from None
    return seen


def _finite(tensor: torch.Tensor, name: str, file: str) -> torch.Tensor:
    """`tensor`, refused when it holds NaN or Inf (a model that computes NaN is not imported).
    FP8 has no isfinite kernel: its NaN/Inf bit patterns are tested on the raw bytes."""
    if not tensor.is_floating_point() or not tensor.numel():
        return tensor
    if tensor.element_size() == 1:
        raw = tensor.view(torch.uint8)
        mask = 0x7F if tensor.dtype == torch.float8_e4m3fn else 0x7C   # e4m3fn: NaN only
        bad = bool(((raw & mask) == mask).any())
    else:
        bad = not bool(torch.isfinite(tensor).all())
    if bad:
        raise ConversionError(f"tensor {name!r} in {file} holds non-finite values (NaN or Inf); "
                              "such a model computes NaN, so it is not imported")
    return tensor


def _available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or 0 when unknown."""
    return available_bytes("cpu")


def _check_sizes(path: str, model_cfg: ModelConfig, files: list, element_bytes: int = 0):
    """Refuses a config.json whose sizes the shard files cannot hold (or, with element_bytes,
    that would not fit in memory) before anything is built or allocated for it."""
    stored = sum(math.prod(e["shape"]) for _, header in files for e in header.values())
    slack = stored + (stored >> 4) + (1 << 20)
    lower = model_cfg.num_layers * 2 * model_cfg.dim + model_cfg.vocab_size * model_cfg.dim
    count = param_count(model_cfg)["total"] if lower <= slack else lower   # no 10^12-layer loop
    if count > slack:
        raise ConversionError(f"{path!r}: config.json describes a model of {count:.3g} parameters "
                              f"but its safetensors files hold {stored:.3g} values; the config "
                              "does not belong to these files (or is damaged)")
    need, have = count * element_bytes, _available_memory()
    if element_bytes and have and need > have:
        raise ConversionError(f"{path!r}: the model needs {need / 2**30:.1f} GiB of memory, "
                              f"this machine has {have / 2**30:.1f} GiB available")


def _read_config(path: str):
    """read_hf_config with every remaining type problem as a ConversionError."""
    try:
        return read_hf_config(path)
    except (TypeError, KeyError, AttributeError) as e:
        raise ConversionError(f"{path!r}: config.json has a setting of the wrong kind ({e!r})") \
            from None


class _ShardWriter:
    """Writes tensors into numbered safetensors shards of at most max_bytes; returns the map."""

    def __init__(self, folder: str, pattern: str, max_bytes: int):
        self.folder, self.pattern, self.max_bytes = folder, pattern, max_bytes
        self.buffer, self.size, self.count, self.weight_map, self.total = {}, 0, 0, {}, 0

    def add(self, name: str, tensor: torch.Tensor):
        if name in self.weight_map or name in self.buffer:
            raise ConversionError(f"tensor {name!r} produced twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self):
        if not self.buffer:
            return
        file = self.pattern.format(self.count)
        save_file(self.buffer, os.path.join(self.folder, file), metadata={"format": "pt"})
        follow_umask(os.path.join(self.folder, file))      # save_file makes 0600
        self.weight_map.update({name: file for name in self.buffer})
        self.count += 1
        self.buffer, self.size = {}, 0


def _write_shards(dst: str, pattern: str, max_bytes: int, stream):
    """Writes the stream's tensors into shards under a new temporary folder beside `dst`
    (`.<name>.tmp-<random>`, never a folder that existed); returns (tmp, writer). On any error
    that folder goes: nothing half-written is left to be mistaken for output."""
    parent, name = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.makedirs(tmp)          # raises if it exists: never reuse (or delete) someone's folder
    writer = _ShardWriter(tmp, pattern, max_bytes)
    try:
        for name, tensor in stream:
            writer.add(name, tensor)
        writer.flush()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, writer


def _checked(expected: dict, stream):
    """Passes (name, tensor) through, refusing names or shapes the model does not have."""
    for name, tensor in stream:
        if name not in expected:
            raise ConversionError(f"tensor {name!r} has no place in the model")
        if not tensor.is_floating_point():
            raise ConversionError(f"tensor {name!r} is stored as {tensor.dtype}; the model "
                                  "holds floating point (integer tensors are refused, not cast)")
        if tuple(tensor.shape) != expected[name]:
            raise ConversionError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                                  f"expects {expected[name]}")
        yield name, tensor


def _stored_mtp_layers(files: list, model_cfg: ModelConfig) -> int:
    """How many of the MTP layers the model config declares the files hold (from the first)."""
    layers = {layer_index(name) for _, header in files for name in header}
    count = 0
    while count < model_cfg.mtp_layers and model_cfg.num_layers + count in layers:
        count += 1
    return count


def _without_mtp(tensors, num_layers: int, num_mtp: int, dropped: list):
    """Drops the multi-token-prediction layers (model.layers.<L .. L+num_mtp-1>.*), recording
    their names in `dropped`; a layer beyond those stays, to be refused as unexpected."""
    for name, tensor in tensors:
        i = layer_index(name)
        if i is not None and num_layers <= i < num_layers + num_mtp:
            dropped.append(name)
            continue
        yield name, tensor


def _canonical_from_hf(path: str, dtype: torch.dtype = torch.bfloat16, log=print,
                       element_bytes: int = 0):
    """(arch, model cfg, router cfg, stream of checked canonical tensors incl. zero expert biases,
    report). Every file is validated and the sizes checked against the files (and memory, with
    element_bytes) first. FP8 weights come dequantized to `dtype`; the MTP layers are dropped
    with a note through `log`, and their names land in report["dropped"] once the stream is
    spent."""
    cfg_json = load_hf_json(path)
    arch, model_cfg, router_cfg = _read_config(path)
    block = quantization_block(cfg_json)     # refuses other quantizations before any tensor
    files = source_files(path)
    stored = _stored_mtp_layers(files, model_cfg)
    if stored != model_cfg.mtp_layers:   # declared, not stored (transformers saves no MTP layer)
        model_cfg = dataclasses.replace(model_cfg, mtp_layers=stored)
    num_mtp = mtp_layers(cfg_json) - model_cfg.mtp_layers    # the ones the model does not keep
    _check_sizes(path, model_cfg, files, element_bytes)
    expected = expected_canonical(model_cfg, router_cfg)
    tied = model_cfg.tie_embeddings
    interleaved = rope_interleaved(cfg_json)
    report = {"dropped": [], "dequantized": block is not None}

    def stream():
        produced = set()
        source = ((n, t) for n, t in hf_tensors(path, files)
                  if not (tied and n == "lm_head.weight"))
        source = dequantized(_without_mtp(source, model_cfg.num_layers + model_cfg.mtp_layers,
                                          num_mtp, report["dropped"]), block, dtype)
        for name, tensor in _checked(expected, hf_to_canonical(arch, model_cfg, source, interleaved)):
            if name in produced:
                raise ConversionError(f"tensor {name!r} appears more than once")
            produced.add(name)
            yield name, tensor
        for name, shape in expected.items():   # what HF checkpoints do not carry
            if name.endswith("expert_bias_E") and name not in produced:
                produced.add(name)
                yield name, torch.zeros(shape)
        missing = sorted(set(expected) - produced)
        if missing:
            raise ConversionError(f"{path!r} lacks {len(missing)} tensor(s) the model needs, e.g. "
                                  f"{missing[:6]}")
        dropped = report["dropped"]
        if dropped:
            layers = sorted({layer_index(n) for n in dropped})
            log(f"note: dropped the multi-token-prediction layer(s) {layers} "
                f"(num_nextn_predict_layers={num_mtp}): {len(dropped)} tensors, e.g. "
                f"{dropped[:3]}; moepar trains next-token prediction only")
    return arch, model_cfg, router_cfg, stream(), report


def _imported_hf_config(cfg: dict, report: dict) -> dict:
    """The source's config.json as it describes the converted weights: no quantization_config
    once dequantized, no MTP layers once dropped (what export writes back)."""
    cfg = dict(cfg)
    if report["dequantized"]:
        cfg.pop("quantization_config", None)
    if report["dropped"]:
        for key in ("num_nextn_predict_layers", "num_mtp_layers"):
            if key in cfg:
                cfg[key] = 0
    return cfg


def hf_to_moepar(src: str, dst: str, max_shard_bytes: int = 2 << 30,
                 dequantize_dtype: torch.dtype = torch.bfloat16, log=print) -> str:
    """Converts a HF folder into a moepar checkpoint directory (atomically); returns dst.
    FP8 block-quantized weights are dequantized to `dequantize_dtype` (bfloat16 or float32)."""
    if os.path.exists(dst):
        raise ConversionError(f"{dst!r} already exists; choose a new directory")
    if dequantize_dtype not in (torch.bfloat16, torch.float32):
        raise ConversionError(f"dequantize dtype {dequantize_dtype} is not bfloat16 or float32")
    arch, model_cfg, router_cfg, stream, report = _canonical_from_hf(src, dequantize_dtype, log)
    tmp, writer = _write_shards(dst, "model-c{:05d}.safetensors", max_shard_bytes, stream)
    notes = []
    if report["dequantized"]:
        notes.append(f"dequantized FP8 weights to {str(dequantize_dtype).removeprefix('torch.')}")
    if report["dropped"]:
        notes.append(f"dropped {len(report['dropped'])} multi-token-prediction tensors "
                     f"(layers {sorted({layer_index(n) for n in report['dropped']})})")
    try:
        files = {"index.json": {"model": writer.weight_map, "optimizer": {}},
                 "state.json": {"step": 0, "data_position": 0, "source": f"hf:{arch.name}",
                                "import_notes": notes,
                                "config": {"model": dataclasses.asdict(model_cfg),
                                           "router": dataclasses.asdict(router_cfg)}},
                 "hf_config.json": _imported_hf_config(load_hf_json(src), report)}
        for name, obj in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=1 if name != "hf_config.json" else 2,
                          sort_keys=name != "hf_config.json")
        run_dir = "runs/" + os.path.basename(os.path.normpath(dst))   # its own, never runs/tiny
        with open(os.path.join(tmp, "config.toml"), "w") as f:
            f.write(f"# converted from {src} ({arch.name}); train with\n"
                    f"#   moepar train {dst}/config.toml --run.init_from={dst} --data.source=... \n"
                    + sections_toml({"model": model_cfg, "router": router_cfg})
                    + f"[run]\ndir = {json.dumps(run_dir)}\n")
        # The tokenizer files beside the weights: `moepar data prepare --tokenizer DST` and
        # `moepar generate DST` read them.
        _copy_tokenizer_files(src, tmp)
        commit(tmp, dst, 0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)     # our own temporary folder, nothing else
        raise
    return dst


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model")


def _copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copies the tokenizer files src holds into dst; returns their names."""
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    for name in found:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return found


def _export_tokenizer(src: str, state: dict, dst: str) -> str:
    """The tokenizer beside an exported model, so transformers' AutoTokenizer finds it: the files
    beside the checkpoint (a converted model), else the tokenizer.json of the prepared folder
    the run trained on, when its SHA-256 is the one the checkpoint recorded. Returns a line
    saying what was done; a tokenizer it cannot vouch for is left out with a note, never a
    failed export."""
    copied = _copy_tokenizer_files(src, dst)
    if copied:
        return f"tokenizer: copied {', '.join(copied)} from {src}"
    data = (state.get("config") or {}).get("data")
    if data is None:
        return ("no tokenizer written: there are no tokenizer files beside the checkpoint, and "
                "it records no training data")
    if data.get("source") != "tokens":
        return ("no tokenizer written: the model trained on bytes (data.source="
                f"{data.get('source', 'builtin')!r}), which no Hugging Face tokenizer file says")
    path = data.get("path") or (data.get("paths") or [""])[0]
    sources = (state.get("dataset") or {}).get("sources") or [{}]
    trained = sources[0].get("tokenizer_sha256")
    if trained == BYTE_TOKENIZER_SHA256:
        return "no tokenizer written: the model trained on bytes (prepared with --tokenizer bytes)"
    file = os.path.join(path, "tokenizer.json")
    try:
        found = file_sha256(file)
    except OSError as e:
        return (f"no tokenizer written: the run's data.path={path!r} has no readable "
                f"tokenizer.json ({e.strerror}); copy the tokenizer beside the model yourself")
    if trained is None or found != trained:
        return (f"no tokenizer written: {file} is not the tokenizer the checkpoint recorded "
                f"(sha256 {found[:12]}..., trained with {str(trained)[:12]}...); copy the "
                "right one beside the model yourself")
    shutil.copyfile(file, os.path.join(dst, "tokenizer.json"))
    return f"tokenizer: copied tokenizer.json from the prepared folder {path}"


def moepar_to_hf(src: str, dst: str, arch_name: str | None = None,
                 max_shard_bytes: int = 2 << 30, log=print) -> str:
    """Writes a moepar checkpoint directory as a HF folder (sharded, with index and config.json).

    The architecture: `arch_name`, else the source's (a converted HF model), else the one the
    model's options match; a model no architecture can say is refused, naming what it has."""
    if os.path.exists(dst):
        raise ConversionError(f"{dst!r} already exists; choose a new directory")
    files = verify_checkpoint(src)
    state = read_state(src)
    try:
        model_cfg, router_cfg = model_sections(state.get("config"), f"{src}/state.json")
    except ValueError as e:
        raise ConversionError(f"{src!r}: state.json holds no usable model config ({e})") from None
    hf_config_file = os.path.join(src, "hf_config.json")
    source_cfg = None
    if "hf_config.json" in files:      # verified with the rest; an unlisted one is not ours
        source_cfg = load_config_json(hf_config_file)
    elif os.path.lexists(hf_config_file):
        log(f"note: {hf_config_file} is not listed in {src}/manifest.json (it was added after "
            "the checkpoint was written): not read; config.json is written from the model")
    fits = matching_archs(model_cfg, router_cfg)
    arch = arch_by_name(arch_name or (source_cfg or {}).get("model_type")
                        or (fits[0] if fits else "qwen3_moe"))   # none fits: qwen3_moe's refusal
    if source_cfg is None or source_cfg.get("model_type") != arch.name:
        source_cfg = hf_config_dict(arch, model_cfg, router_cfg)
    else:   # the source's config.json, with the balance loss this model trains now
        source_cfg.update(router_loss_fields(arch, model_cfg, router_cfg))
    for note in export_notes(arch, router_cfg, model_cfg):
        log(f"note: {note}")
    expected = expected_canonical(model_cfg, router_cfg)
    missing = sorted(set(expected) - set(canonical_names(src)))
    if missing:
        raise ConversionError(f"{src!r} lacks {len(missing)} tensor(s), e.g. {missing[:6]}")

    def canonical():   # one whole tensor at a time, assembled from its stored pieces
        yield from read_canonical(src, verify=False)

    tmp, writer = _write_shards(dst, "part-{:05d}.safetensors", max_shard_bytes,
                                canonical_to_hf(arch, model_cfg, _checked(expected, canonical()),
                                                rope_interleaved(source_cfg)))
    try:
        names = {f"part-{i:05d}.safetensors":
                 f"model-{i + 1:05d}-of-{writer.count:05d}.safetensors" for i in range(writer.count)}
        for old, new in names.items():
            os.rename(os.path.join(tmp, old), os.path.join(tmp, new))
        weight_map = {k: names[v] for k, v in sorted(writer.weight_map.items())}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": writer.total}, "weight_map": weight_map}, f,
                      indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(source_cfg, f, indent=2)
        log(_export_tokenizer(src, state, tmp))
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)     # our own temporary folder, nothing else
        raise
    return dst


class CausalLM(torch.nn.Module):
    """A moepar Transformer whose forward(input_ids [B, T]) returns logits [B, T, V] only."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids)[0]


def from_hf(path: str, dtype: torch.dtype = torch.float32, log=print) -> CausalLM:
    """Builds the moepar model for a HF folder and loads its weights (checked for completeness).

    Tensors are copied into the model one by one as they stream in: memory holds the model and
    one source tensor, never a second copy of the weights. FP8 weights are dequantized to
    `dtype`; multi-token-prediction layers are dropped with a note through `log`.
    """
    element_bytes = torch.empty((), dtype=dtype).element_size()
    arch, model_cfg, router_cfg, stream, _ = _canonical_from_hf(path, dtype, log, element_bytes)
    with torch.device("meta"):   # no initial values: every tensor comes from the source
        model = Transformer(model_cfg, router_cfg, seed=0)
    model = model.to(dtype).to_empty(device="cpu")
    reset_rope_buffers(model, model_cfg)
    targets = model.state_dict()
    stacks = {name: {"w_in": m.w_in_EDU, "w_out": m.w_out_EFD} for name, m in model.named_modules()
              if isinstance(m, GroupedExperts)}
    with torch.no_grad():
        for name, tensor in stream:          # names and shapes already checked against the model
            prefix, _, short = name.rpartition(".")
            owner, _, expert = prefix.rpartition(".")
            if owner in stacks and expert.isdigit():
                stacks[owner][short][int(expert)].copy_(tensor)
            else:
                targets[name].copy_(tensor)
    return CausalLM(model.eval())
