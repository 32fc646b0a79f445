"""The one way moepar reads the JSON and TOML files it is given: regular files only, a size and a
nesting limit, and a schema of types, ranges and finite numbers; every refusal is a `FileError`
that names the file, the key and what was expected.

    read_json(path, schema)      a whole JSON file (manifest.json, index.json, config.json, ...)
    parse_json(text, where, schema)  JSON held in memory (a line of metrics.jsonl, a header)
    read_toml(path)              a TOML config
    open_regular(path)           a file object, refused unless `path` is a regular file
    check_regular(path)          the same check, for libraries that open a path themselves

Why a pre-scan: Python's json and tomllib recurse once per nesting level, so 10,000 nested
brackets end in a RecursionError deep inside the parser; counting the brackets outside strings
first (a regular expression and a cumulative sum, about a third of the parse's own time) refuses
such a file by name. Why not the `jsonschema` package: a new dependency for what is ~100 lines
here, and its messages name JSON pointers, not the moepar key a user knows. Why O_NONBLOCK:
opening a FIFO for reading blocks until a writer comes; with it the open returns at once and
fstat says what the path is, so a FIFO, a device or a directory is refused before any read.
"""

import errno
import json
import math
import os
import re
import stat
import tomllib

import numpy as np

__all__ = ["FileError", "MAX_DEPTH", "open_regular", "check_regular", "read_bytes", "parse_json",
           "read_json", "read_toml", "decode_utf8", "Int", "Num", "Str", "Bool", "List", "Obj",
           "Map", "OneOf", "Opt", "ANY"]

MAX_DEPTH = 64                 # nesting levels; moepar's own files use at most 6
MAX_JSON = 256 << 20           # bytes; a checkpoint index of a very large model is tens of MiB
MAX_TOML = 4 << 20             # bytes; a run config is a few KiB


class FileError(ValueError):
    """A file that cannot be read as asked: not a regular file, too large or nested too deeply,
    not UTF-8, not valid JSON/TOML, or a value of the wrong type or range. The message names the
    file (and the key)."""


# ---- regular files ----------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _os_error(path: str, e: OSError, what: str) -> FileError:
    reason = {errno.ENOENT: "does not exist", errno.ELOOP: "is a symlink loop (or too many "
              "levels of symlinks)", errno.ENAMETOOLONG: "has a name too long for the filesystem",
              errno.EACCES: "is not readable (permission denied)",
              errno.ENOTDIR: "has a part that is not a directory"}.get(e.errno)
    return FileError(f"{what}{path!r} {reason or f'cannot be opened ({e.strerror})'}")


def _label(what: str) -> str:
    return f"{what} " if what else ""


def check_regular(path: str, what: str = "") -> os.stat_result:
    """os.stat(path) (symlinks followed) when it is a regular file; FileError naming `what` and
    the path otherwise (missing, a directory, a FIFO, a device, a symlink loop, ...)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:      # ValueError: a NUL byte in the path
        if isinstance(e, ValueError):
            raise FileError(f"{_label(what)}{path!r} holds a NUL byte") from None
        raise _os_error(path, e, _label(what)) from None
    if not stat.S_ISREG(st.st_mode):
        raise FileError(f"{_label(what)}{path!r} is {_kind(st.st_mode)}, not a regular file")
    return st


def open_regular(path: str, what: str = ""):
    """The file at `path` opened for binary reading, refused (FileError) unless it is a regular
    file: opened with O_NONBLOCK so that a FIFO cannot block, then checked with fstat."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except ValueError:
        raise FileError(f"{_label(what)}{path!r} holds a NUL byte") from None
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise FileError(f"{_label(what)}{path!r} is a directory, not a regular file") from None
        raise _os_error(path, e, _label(what)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileError(f"{_label(what)}{path!r} is {_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str, limit: int, what: str = "") -> bytes:
    """A regular file's bytes, refused when it holds more than `limit` (a /dev/zero or a
    mistaken multi-GiB file never fills memory)."""
    with open_regular(path, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileError(f"{_label(what)}{path!r} is larger than {limit:,} bytes, more than any "
                        "such file needs")
    return data


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as UTF-8 text, or a FileError naming `where`, the line and the column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FileError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, "
                        f"column {column})") from None


# ---- nesting ----------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
# TOML: comments, multi-line and single-line basic and literal strings
_TOML_SKIP = re.compile(rb'#[^\n]*|"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|'
                        rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'', re.S)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def _bracket_depth(text: bytes, skip: re.Pattern) -> int:
    """The deepest nesting of [ and { outside strings (and comments), by a cumulative sum in
    chunks (a hostile file of brackets needs no more memory than a chunk)."""
    brackets = skip.sub(b"", text).translate(None, _NOT_BRACKET)
    deepest, level, chunk = 0, 0, 1 << 22
    for start in range(0, len(brackets), chunk):
        steps = _STEP[np.frombuffer(brackets, np.uint8, min(chunk, len(brackets) - start), start)]
        running = np.cumsum(steps, dtype=np.int64) + level
        deepest, level = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _check_depth(text: bytes, skip: re.Pattern, where: str, limit: int):
    depth = _bracket_depth(text, skip)
    if depth > limit:
        raise FileError(f"{where}: nested {depth} levels deep, more than the {limit} any moepar "
                        "file needs (damaged or not a moepar file)")


def _tree_depth(obj, where: str, limit: int):
    """The nesting of a parsed tree, without recursion (TOML's dotted keys nest without
    brackets)."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise FileError(f"{where}: nested more than {limit} levels deep, more than any "
                            "moepar file needs")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


# ---- parsing ----------------------------------------------------------------------------------

def parse_json(text, where: str, schema=None, max_depth: int = MAX_DEPTH):
    """The JSON value in `text` (bytes or str), checked against `schema` (None: any value);
    FileError naming `where` otherwise. NaN and Infinity literals parse to floats, and a schema
    that wants a finite number refuses them (moepar's own metrics.jsonl writes NaN losses)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if isinstance(text, bytes):
        text = decode_utf8(data, where)
    _check_depth(data, _JSON_STRING, where, max_depth)
    try:
        value = json.loads(text)
    except ValueError as e:        # JSONDecodeError, or an integer of more than 4300 digits
        raise FileError(f"{where} is not valid JSON ({e})") from None
    if schema is not None:
        schema.check(value, where, "")
    return value


def read_json(path: str, schema=None, what: str = "", limit: int = MAX_JSON):
    """A JSON file (regular, at most `limit` bytes), checked against `schema`."""
    return parse_json(read_bytes(path, limit, what), f"{_label(what)}{path}", schema)


def read_toml(path: str, what: str = "config file", limit: int = MAX_TOML) -> dict:
    """A TOML file as a dict (regular, at most `limit` bytes, UTF-8, nesting limited)."""
    where = f"{_label(what)}{path!r}"
    data = read_bytes(path, limit, what)
    text = decode_utf8(data, where)
    _check_depth(data, _TOML_SKIP, where, MAX_DEPTH)
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FileError(f"{where} is not valid TOML: {e}") from None
    _tree_depth(tree, where, MAX_DEPTH)
    return tree


# ---- schemas ----------------------------------------------------------------------------------

def _shown(value) -> str:
    if isinstance(value, dict):
        return f"an object of {len(value)} key(s)"
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _key(at: str) -> str:
    return f"key '{at}'" if at else "the top level"


class _Schema:
    expected = "a value"

    def fail(self, value, where: str, at: str, expected: str | None = None):
        raise FileError(f"{where}: {_key(at)} is {_shown(value)}, expected "
                        f"{expected or self.expected}")

    def check(self, value, where: str, at: str):
        raise NotImplementedError


class _Any(_Schema):
    def check(self, value, where, at):
        return value


ANY = _Any()


class Int(_Schema):
    """A whole number (not a bool, not a float) in [lo, hi]."""

    def __init__(self, lo: int = 0, hi: int = (1 << 63) - 1):
        self.lo, self.hi = lo, hi
        self.expected = f"a whole number in [{lo}, {hi}]"

    def check(self, value, where, at):
        if type(value) is not int or not self.lo <= value <= self.hi:
            self.fail(value, where, at)
        return value


class Num(_Schema):
    """A finite number (int or float, not a bool) in [lo, hi]."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf):
        self.lo, self.hi = lo, hi
        self.expected = ("a finite number" + (f" in [{lo}, {hi}]" if math.isfinite(lo) or
                                              math.isfinite(hi) else ""))

    def check(self, value, where, at):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not (math.isfinite(value) and self.lo <= value <= self.hi):
            self.fail(value, where, at)
        return value


class Str(_Schema):
    """A string, optionally one of `choices` or matching `pattern` (whole)."""

    def __init__(self, choices=None, pattern: str | None = None, max_len: int = 1 << 20):
        self.choices, self.max_len = choices, max_len
        self.pattern = re.compile(pattern) if pattern else None
        self.expected = ("one of " + ", ".join(map(repr, choices)) if choices else
                         f"a string matching {pattern}" if pattern else "a string")

    def check(self, value, where, at):
        if not isinstance(value, str) or len(value) > self.max_len or \
                (self.choices is not None and value not in self.choices) or \
                (self.pattern is not None and not self.pattern.fullmatch(value)):
            self.fail(value, where, at)
        return value


class Bool(_Schema):
    expected = "true or false"

    def check(self, value, where, at):
        if not isinstance(value, bool):
            self.fail(value, where, at)
        return value


class Opt(_Schema):
    """`schema`, or null."""

    def __init__(self, schema: _Schema):
        self.schema = schema
        self.expected = f"{schema.expected}, or null"

    def check(self, value, where, at):
        return None if value is None else self.schema.check(value, where, at)


class List(_Schema):
    def __init__(self, item: _Schema = ANY, min_len: int = 0, max_len: int = 1 << 40):
        self.item, self.min_len, self.max_len = item, min_len, max_len
        count = (f" of {min_len}" if min_len == max_len else
                 f" of at least {min_len}" if min_len else "")
        self.expected = f"a list{count} ({item.expected} each)" if item is not ANY else \
            f"a list{count}"

    def check(self, value, where, at):
        if not isinstance(value, list) or not self.min_len <= len(value) <= self.max_len:
            self.fail(value, where, at)
        for i, item in enumerate(value):
            self.item.check(item, where, f"{at}[{i}]")
        return value


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


class Obj(_Schema):
    """An object with these `fields` ({key: schema}); `required` keys must be there; other keys
    pass unchecked (files of newer moepar versions may carry more)."""

    def __init__(self, fields: dict, required=()):
        self.fields, self.required = fields, tuple(required)
        self.expected = ("an object with " + ", ".join(repr(k) for k in self.required)
                         if self.required else "an object")

    def check(self, value, where, at):
        if not isinstance(value, dict):
            self.fail(value, where, at)
        missing = [k for k in self.required if k not in value]
        if missing:
            raise FileError(f"{where}: {_key(at)} lacks {', '.join(map(repr, missing))}")
        for key, schema in self.fields.items():
            if key in value:
                schema.check(value[key], where, _join(at, key))
        return value


class Map(_Schema):
    """An object whose every value is `value` (keys any strings, or `key`)."""

    def __init__(self, value: _Schema = ANY, key: _Schema | None = None):
        self.value, self.key = value, key
        self.expected = f"an object ({value.expected} each)" if value is not ANY else "an object"

    def check(self, value, where, at):
        if not isinstance(value, dict):
            self.fail(value, where, at)
        for k, v in value.items():
            if self.key is not None and not (isinstance(k, str) and self.key.check(k, where,
                                                                                   _join(at, k))):
                self.fail(k, where, at, f"keys that are {self.key.expected}")
            self.value.check(v, where, _join(at, k))
        return value


class OneOf(_Schema):
    """The first of `schemas` whose outer type fits (a str, a list, an object...)."""

    def __init__(self, *schemas: _Schema, kinds: tuple):
        self.schemas, self.kinds = schemas, kinds
        self.expected = " or ".join(s.expected for s in schemas)

    def check(self, value, where, at):
        for schema, kind in zip(self.schemas, self.kinds, strict=True):
            if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
                return schema.check(value, where, at)
        self.fail(value, where, at)
