"""Safetensors files written one tensor at a time with block hashes, and read by boxes after
their header and the blocks a read touches have been checked.

The file format is plain safetensors (8-byte little-endian header length, JSON header, raw
little-endian data), so any safetensors reader opens our files. What is ours:
- writing streams: the header is computed from shapes first, then each tensor's bytes are
  produced and written in turn, so memory holds one tensor (or a bounded chunk of it);
- while writing, SHA-256 is taken over fixed blocks of the file (`BLOCK` bytes) and over the
  whole file: a reader that needs a few byte ranges verifies only the blocks they touch;
- headers are validated before anything is read (length, JSON, dtypes, shapes, offsets inside
  the file, no overlaps), so a damaged or hostile file is a `TensorFileError` naming the file
  and the problem, never a crash inside a parser.
"""

import hashlib
import json
import math
import os
import struct

import numpy as np
import torch

from moepar.jsonfile import FileError, check_regular, open_regular, parse_json

__all__ = ["TensorFileError", "BLOCK", "DTYPES", "dtype_name", "data_offsets", "write_tensors",
           "read_header",
           "check_blocks", "read_box", "box_bytes", "file_digest"]

BLOCK = 32 << 20                 # bytes per hashed block
_READ = 1 << 20                  # bytes read at a time while hashing
MAX_HEADER = 64 << 20            # a header larger than this is refused (no real file needs it)

# safetensors dtype name -> (torch dtype, numpy carrier dtype of the same width)
DTYPES = {
    "F64": (torch.float64, np.float64), "F32": (torch.float32, np.float32),
    "F16": (torch.float16, np.float16), "BF16": (torch.bfloat16, np.uint16),
    "I64": (torch.int64, np.int64), "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16), "I8": (torch.int8, np.int8), "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
    "F8_E4M3": (torch.float8_e4m3fn, np.uint8), "F8_E5M2": (torch.float8_e5m2, np.uint8),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


class TensorFileError(ValueError):
    """A tensor file that is missing, truncated, malformed or does not match its hashes."""


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


class _HashingFile:
    """A file being written, hashed in BLOCK-sized blocks and as a whole."""

    def __init__(self, path: str | None):
        self.f = open(path, "wb") if path is not None else None   # None: hash only
        self.whole, self.block, self.filled, self.blocks, self.size = (
            hashlib.sha256(), hashlib.sha256(), 0, [], 0)

    def write(self, data):
        view = memoryview(data).cast("B")
        if self.f is not None:
            self.f.write(view)
        self.whole.update(view)
        self.size += len(view)
        while len(view):
            take = min(BLOCK - self.filled, len(view))
            self.block.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == BLOCK:
                self.blocks.append(self.block.hexdigest())
                self.block, self.filled = hashlib.sha256(), 0

    def close(self) -> dict:
        if self.filled or not self.blocks:
            self.blocks.append(self.block.hexdigest())
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        return {"size": self.size, "sha256": self.whole.hexdigest(), "block": BLOCK,
                "blocks": self.blocks}


def data_offsets(entries: list) -> dict:
    """{key: [start, stop]}: where `write_tensors` puts each entry's bytes in the data."""
    out, offset = {}, 0
    for key, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[key] = [offset, offset + nbytes]
        offset += nbytes
    return out


def write_tensors(path: str, entries: list, metadata: dict | None = None, check=None) -> dict:
    """Writes a safetensors file from entries (key, dtype, shape, produce) in order, calling
    produce() -> contiguous CPU tensor for one entry at a time; returns the file's hash entry
    (size, sha256, block hashes), for the checkpoint manifest. `check(key, tensor)` sees each
    tensor before it is written and may raise."""
    spans = data_offsets(entries)
    header = {key: {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": spans[key]}
              for key, dtype, shape, _ in entries}
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = _HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for key, dtype, shape, produce in entries:
            tensor = produce()
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or tensor.is_cuda:
                raise ValueError(f"{key}: produced {tensor.dtype} {tuple(tensor.shape)} on "
                                 f"{tensor.device}, expected {dtype} {tuple(shape)} on the host")
            if check is not None:
                check(key, tensor)
            if tensor.numel():
                out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    finally:
        digest = out.close()
    return digest


def read_header(path: str) -> tuple[dict, int]:
    """({key: {"dtype", "shape", "data_offsets"}}, byte offset of the data) after checking
    everything a reader relies on, field by field; TensorFileError naming the file otherwise."""
    name = os.path.basename(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise TensorFileError(f"{name}: {size} bytes, too short for a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > min(MAX_HEADER, size - 8):
                raise TensorFileError(f"{name}: header length {length} exceeds the file "
                                      f"({size} bytes) or {MAX_HEADER} bytes")
            text = f.read(length)
        header = parse_json(text, f"{name}: the header")
    except FileError as e:
        raise TensorFileError(str(e).replace(repr(path), name, 1)) from None
    except OSError as e:
        raise TensorFileError(f"{name}: cannot be read ({e.strerror})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{name}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"{name}: the header's __metadata__ is not an object of strings")
    data_size = size - 8 - length
    spans = []
    for key, entry in header.items():
        where = f"{name}: tensor {key!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise TensorFileError(f"{where} has a malformed header entry (it needs exactly "
                                  "dtype, shape and data_offsets)")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise TensorFileError(f"{where} has dtype {dtype!r}, not one of "
                                  f"{', '.join(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(type(n) is int and n >= 0 for n in shape)):
            raise TensorFileError(f"{where} has an invalid shape {shape!r} (a list of whole "
                                  "numbers >= 0)")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise TensorFileError(f"{where} has invalid data offsets {offsets!r} (two whole "
                                  "numbers, start <= stop)")
        itemsize = np.dtype(DTYPES[dtype][1]).itemsize
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise TensorFileError(f"{where}: {offsets[1] - offsets[0]} bytes of data for shape "
                                  f"{shape} of {dtype}")
        if offsets[1] > data_size:
            raise TensorFileError(f"{where} ends at byte {offsets[1]}, past the end of the data "
                                  f"({data_size} bytes; the file is truncated or damaged)")
        spans.append((offsets[0], offsets[1], key))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise TensorFileError(f"{name}: tensors {first!r} and {second!r} overlap")
    return header, 8 + length


def file_digest(path: str) -> dict:
    """The hash entry `write_tensors` returns, for a file written another way (JSON files,
    conversion output), computed reading 1 MiB at a time."""
    out = _HashingFile(None)
    with open_regular(path) as f:
        while chunk := f.read(_READ):
            out.write(chunk)
    return out.close()


def check_blocks(path: str, digest, ranges=None):
    """Verifies `path` against its manifest entry: the blocks that the byte `ranges`
    [(start, stop)] touch (None: the whole file). A plain string entry is a whole-file SHA-256
    (checkpoints from before block hashes)."""
    name = os.path.basename(path)
    if not os.path.lexists(path):
        raise TensorFileError(f"{name} is missing")
    try:
        size = check_regular(path).st_size
    except FileError as e:
        raise TensorFileError(str(e).replace(repr(path), name, 1)) from None
    if isinstance(digest, str):
        if file_digest(path)["sha256"] != digest:
            raise TensorFileError(f"{name} does not match its SHA-256 (corrupt or modified)")
        return
    if not isinstance(digest, dict) or not {"size", "block", "blocks"} <= set(digest):
        raise TensorFileError(f"{name}: its manifest entry is malformed")
    block, blocks = digest["block"], digest["blocks"]
    if size != digest["size"]:
        raise TensorFileError(f"{name} has {size} bytes, its manifest says {digest['size']} "
                              "(truncated or modified)")
    if not isinstance(block, int) or block < 1 or len(blocks) != max(1, -(-size // block)):
        raise TensorFileError(f"{name}: its manifest's block hashes do not fit the file")
    wanted = range(len(blocks)) if ranges is None else sorted(
        {b for start, stop in ranges for b in range(start // block, max(start, stop - 1) // block + 1)})
    with open_regular(path) as f:
        for b in wanted:
            f.seek(b * block)
            digest, left = hashlib.sha256(), block
            while left and (chunk := f.read(min(left, _READ))):   # 1 MiB in memory at a time
                digest.update(chunk)
                left -= len(chunk)
            if digest.hexdigest() != blocks[b]:
                raise TensorFileError(f"{name} does not match its SHA-256 at bytes "
                                      f"[{b * block}, {min((b + 1) * block, size)}) "
                                      "(corrupt or modified)")


def box_bytes(entry: dict, data_start: int, offsets, sizes) -> tuple[int, int]:
    """The byte range [start, stop) of the file that a box of a stored tensor lies in (its rows
    along dim 0, whole)."""
    base = data_start + entry["data_offsets"][0]
    shape = entry["shape"]
    itemsize = np.dtype(DTYPES[entry["dtype"]][1]).itemsize
    if not shape:
        return base, base + itemsize
    row = math.prod(shape[1:]) * itemsize
    return base + offsets[0] * row, base + (offsets[0] + sizes[0]) * row


def read_box(path: str, entry: dict, data_start: int, offsets, sizes) -> torch.Tensor:
    """The box (offsets, sizes) of one stored tensor, read through a memory map (only the pages
    the box touches are read), as a new host tensor."""
    torch_dtype, carrier = DTYPES[entry["dtype"]]
    start = data_start + entry["data_offsets"][0]
    shape = tuple(entry["shape"])
    if math.prod(shape) == 0 or math.prod(sizes) == 0:
        return torch.empty(tuple(sizes), dtype=torch_dtype)
    array = np.memmap(path, dtype=carrier, mode="r", offset=start, shape=shape)
    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    data = torch.from_numpy(np.array(array[box], copy=True))
    del array
    return data.view(torch_dtype) if data.dtype != torch_dtype else data
