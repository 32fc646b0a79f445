"""Every reader, fuzzed through the real CLI (`moepar.cli.main`, in-process; FIFOs and sizes that
used to hang in a subprocess with a timeout): each mutated input is either accepted or refused
with a `moepar` message naming the file (and no traceback), and a refused start changes nothing.
Then one regression test per class of issue 30's fuzz campaign.

The mutators are our own and deterministic (no hypothesis): for each JSON file a reader takes,
the whole file replaced (nested 10,000 deep, not UTF-8, truncated, a list, empty) and chosen
keys set to values of every wrong kind (list, object, string, null, NaN, Infinity, 1e400, -1,
2**70), two kinds per key, picked by a generator seeded by the key. A file inside a
checkpoint is re-hashed in its manifest after the damage ("deliberate, not accidental"), so the
hash check alone cannot catch it.
"""

import contextlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from configs import tiny_config, tiny_mixtral
from moepar.cli import main as cli_main
from moepar.config import to_toml
from moepar.tensorfile import file_digest
from moepar.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRONG = ["list", "object", "string", "null", "nan", "inf", "1e400", "-1", "2**70"]
_LITERAL = {"nan": "NaN", "inf": "Infinity", "1e400": "1e400"}
_VALUE = {"list": [1], "object": {"a": 1}, "string": "x", "null": None, "-1": -1,
          "2**70": 2 ** 70}


def quiet(_msg):
    pass


def cli(*argv) -> tuple[int, str]:
    """(exit code, stderr + stdout) of `moepar ARGV` in this process; an exception escaping
    main is a traceback, so it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([str(a) for a in argv])
    return rc, err.getvalue() + out.getvalue()


def tree(path: str) -> dict:
    """{relative path: bytes or 'dir'} of everything under path (what 'nothing changed' means;
    run.lock names its latest holder, whatever that start did)."""
    found = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            found[os.path.relpath(os.path.join(root, d), path)] = "dir"
        for f in files:
            if f == "run.lock" and root == path:
                continue
            p = os.path.join(root, f)
            found[os.path.relpath(p, path)] = "link" if os.path.islink(p) else open(p, "rb").read()
    return found


def set_key(obj, dotted: str, kind: str):
    """obj with the value at `dotted` (keys and list indices, '/' between) replaced by a `kind`
    sentinel."""
    *parents, last = dotted.split("/")
    node = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = f"__{kind}__" if kind in _LITERAL else _VALUE[kind]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return obj


def dump(obj) -> bytes:
    text = json.dumps(obj)
    for kind, literal in _LITERAL.items():
        text = text.replace(f'"__{kind}__"', literal)
    return text.encode()


WHOLE = {"deep": b"[" * 10000 + b"]" * 10000, "not_utf8": b'{"a": "\xff\xfe"}',
         "list": b"[1, 2]", "empty": b""}


def mutations(path: str, keys: list[str]):
    """(name, new bytes) for the file at `path`: whole-file damage, then wrong kinds per key."""
    original = open(path, "rb").read()
    for name, data in WHOLE.items():
        yield name, data
    yield "truncated", original[:len(original) // 2]
    for key in keys:
        for kind in random.Random(key).sample(WRONG, 2):
            yield f"{key}={kind}", dump(set_key(json.loads(original), key, kind))


def rehash(folder: str, name: str):
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    manifest["files"][name] = file_digest(os.path.join(folder, name))
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def assert_named(rc: int, text: str, names: list[str], case: str):
    """Accepted (0), or refused with a `moepar` message that names one of `names`."""
    assert "Traceback" not in text, f"{case}: {text[-2000:]}"
    if rc != 0:
        assert "moepar" in text and any(n in text for n in names), f"{case}: rc={rc}\n{text[-1500:]}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A config file, a two-step run (checkpoints step_1, step_2), a prepared token folder, a
    tiny Hugging Face Mixtral and its conversion."""
    base = tmp_path_factory.mktemp("world")
    run = base / "run"
    Trainer(tiny_config(run, "--train.steps=2", "--run.checkpoint_every=1",
                        "--run.keep_checkpoints=0"), log=quiet).run()
    config = base / "tiny.toml"
    config.write_text(to_toml(tiny_config(base / "unused")))
    from moepar.data.prepare import PrepareOptions, prepare
    text = base / "text.txt"
    rng = random.Random(0)
    text.write_text("\n\n".join("".join(rng.choice("abcdefgh ") for _ in range(80))
                                for _ in range(80)))
    tokens = base / "tokens"
    prepare(PrepareOptions(tokenizer="bytes", inputs=[str(text)], out=str(tokens),
                           split_blank_lines=True, val_fraction=0.2), stderr=open(os.devnull, "w"))
    w = {"base": base, "run": run, "config": config, "tokens": tokens}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return w
    hf = base / "hf"
    tiny_mixtral(hf)
    from moepar.hf import hf_to_moepar
    hf_to_moepar(str(hf), str(base / "converted"), log=quiet)
    return dict(w, hf=hf, converted=base / "converted")


class Fresh:
    """Numbered scratch paths inside one test's tmp_path."""

    def __init__(self, tmp_path):
        self.tmp, self.n = tmp_path, 0

    def __call__(self, name: str):
        self.n += 1
        return self.tmp / f"{self.n:03d}-{name}"


# ---- the fuzz: every reader, every mutation --------------------------------------------------

CHECKPOINT_KEYS = {
    "manifest.json": ["world_size", "step", "format", "files", "files/model-r00000.safetensors",
                      "files/model-r00000.safetensors/blocks",
                      "files/model-r00000.safetensors/size"],
    "index.json": ["model", "optimizer", "model/embed.weight", "model/embed.weight/pieces",
                   "model/embed.weight/pieces/0/offsets", "model/embed.weight/shape"],
    "state.json": ["step", "data_position", "config", "config/train", "config/model",
                   "config/model/num_layers", "dataset", "dataset/sources"],
}


@pytest.mark.parametrize("name", sorted(CHECKPOINT_KEYS))
def test_fuzz_checkpoint_files_on_resume(world, tmp_path, name):
    fresh = Fresh(tmp_path)
    step2 = world["run"] / "checkpoints" / "step_2"
    for case, data in mutations(str(step2 / name), CHECKPOINT_KEYS[name]):
        ckpt = fresh("step_2")
        shutil.copytree(step2, ckpt)
        (ckpt / name).write_bytes(data)
        if name != "manifest.json":
            rehash(str(ckpt), name)
        before = tree(str(ckpt))
        run_dir = fresh("run")
        rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=2",
                       f"--run.resume_from={ckpt}")
        # a resume that changes the config names the checkpoint and the key instead
        assert_named(rc, text, [name, "manifest.json", f"resuming {ckpt} with a config"],
                     f"{name} {case}")
        assert tree(str(ckpt)) == before, f"{name} {case}: the checkpoint changed"
        if rc != 0:
            assert not os.path.exists(run_dir / "checkpoints"), f"{name} {case}: run.dir changed"


TOKEN_KEYS = ["dtype", "tokenizer", "tokenizer/vocab_size", "tokenizer/eos_id", "splits",
              "splits/train", "splits/train/shards", "splits/train/shards/0/file",
              "splits/train/shards/0/num_tokens", "splits/train/shards/0/sha256"]


def test_fuzz_token_folder_index(world, tmp_path):
    fresh = Fresh(tmp_path)
    for case, data in mutations(str(world["tokens"] / "index.json"), TOKEN_KEYS):
        folder = fresh("tokens")
        shutil.copytree(world["tokens"], folder)
        (folder / "index.json").write_bytes(data)
        rc, text = cli("train", world["config"], f"--run.dir={fresh('run')}", "--train.steps=1",
                       "--data.source=tokens", f"--data.path={folder}")
        assert_named(rc, text, ["index.json"], case)


HF_KEYS = ["hidden_size", "num_hidden_layers", "vocab_size", "num_local_experts",
           "num_experts_per_tok", "max_position_embeddings", "rope_theta", "rms_norm_eps",
           "num_nextn_predict_layers", "quantization_config", "model_type",
           "tie_word_embeddings", "rope_scaling"]


def test_fuzz_hf_config_on_convert_and_generate(world, tmp_path):
    pytest.importorskip("transformers")
    fresh = Fresh(tmp_path)
    for case, data in mutations(str(world["hf"] / "config.json"), HF_KEYS):
        folder = fresh("hf")
        shutil.copytree(world["hf"], folder)
        (folder / "config.json").write_bytes(data)
        dst = fresh("out")
        rc, text = cli("convert", "--from", "hf", folder, "--to", "moepar", dst)
        assert_named(rc, text, ["config.json"], f"convert {case}")
        assert rc == 0 or not os.path.exists(dst), f"{case}: a refused conversion left {dst}"
        if case.startswith(("hidden_size", "num_hidden_layers", "quantization_config")):
            rc, text = cli("generate", folder, "--prompt", "ab", "--max-new-tokens", "2",
                           "--tokenizer", "bytes", "--device", "cpu")
            assert_named(rc, text, ["config.json"], f"generate {case}")


def test_fuzz_hf_config_beside_a_checkpoint(world, tmp_path):
    """hf_config.json of a converted checkpoint, read by `convert --to hf`."""
    pytest.importorskip("transformers")
    fresh = Fresh(tmp_path)
    for case, data in mutations(str(world["converted"] / "hf_config.json"),
                                ["model_type", "hidden_size", "num_local_experts"]):
        ckpt = fresh("converted")
        shutil.copytree(world["converted"], ckpt)
        (ckpt / "hf_config.json").write_bytes(data)
        rehash(str(ckpt), "hf_config.json")
        rc, text = cli("convert", "--from", "moepar", ckpt, "--to", "hf", fresh("out"))
        assert_named(rc, text, ["hf_config.json"], case)


def test_fuzz_run_dir_files_on_resume(world, tmp_path):
    """diverged.json, metrics.jsonl, expert_load.jsonl and config.toml (run.resume=auto with
    no checkpoint) of a run directory."""
    fresh = Fresh(tmp_path)
    record = {"step": 1, "reason": "r", "time": "t", "config": {"train": {"lr": 1.0}}}
    (tmp_path / "diverged.json").write_text(json.dumps(record))
    cases = [("diverged.json", c, d, "--run.resume=true") for c, d in
             mutations(str(tmp_path / "diverged.json"), ["step", "reason", "config"])]
    for name in ("metrics.jsonl", "expert_load.jsonl"):
        lines = (world["run"] / name).read_bytes().split(b"\n")
        cases += [(name, c, b"\n".join([lines[0], d, *lines[1:]]), "--run.resume=true")
                  for c, d in WHOLE.items()]
        cases.append((name, "step=inf", b'{"step": Infinity}\n' + b"\n".join(lines),
                      "--run.resume=true"))
    cases += [("config.toml", c, d, "--run.resume=auto") for c, d in
              [("deep", b"a = " + b"[" * 10000 + b"]" * 10000), ("not_utf8", b'x = "\xff"'),
               ("dotted", b"a" + b".a" * 10000 + b" = 1"), ("list", b"model = [1]")]]
    for name, case, data, resume in cases:
        run_dir = fresh("run")
        shutil.copytree(world["run"], run_dir)
        if name == "config.toml":
            shutil.rmtree(run_dir / "checkpoints")
        (run_dir / name).write_bytes(data)
        before = tree(str(run_dir))
        rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=2",
                       resume)
        assert_named(rc, text, [name], f"{name} {case}")
        if rc != 0:
            assert tree(str(run_dir)) == before, f"{name} {case}: a refused start changed run.dir"


def test_fuzz_config_files(world, tmp_path):
    text = world["config"].read_bytes()
    cases = dict(WHOLE, truncated=text[:len(text) // 3] + b"[[[", nul=text.replace(
        b"[run]", b"[run]\ndir = \"a\\u0000b\"\n[run_]"))
    for case, data in cases.items():
        path = tmp_path / f"{case}.toml"
        path.write_bytes(data)
        rc, out = cli("train", path, "--dry-run")
        assert_named(rc, out, [path.name, "run.dir="], case)   # a bad value: its key
        assert rc in (0, 2), case


# ---- FIFOs and sizes: a hang is the failure, so they run in a subprocess --------------------

def run_cases(cases: list[list[str]], timeout: float = 120) -> list[tuple[int, str]]:
    """Runs each argv through moepar.cli.main in one fresh Python process (one import for
    all), with a timeout: a case that blocks fails the test instead of hanging it."""
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from moepar.cli import main
        for argv in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    rc = main(argv)
                except BaseException as e:
                    rc, err = 99, io.StringIO(f"Traceback: {e!r}")
            print(json.dumps([rc, err.getvalue()]), flush=True)
    """)
    try:
        result = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=ROOT,
                                capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        done = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"case {len(done.splitlines())} of {cases} hung ({timeout} s)")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == len(cases), result.stderr[-3000:]
    return rows


def test_fifos_and_devices_are_refused_by_name_not_read(world, tmp_path):
    """Class 9 and 13: a FIFO as a checkpoint's model file, a token shard, an HF shard and the
    config; a directory, /dev/zero and a symlink loop as the config."""
    ckpt = tmp_path / "step_2"
    shutil.copytree(world["run"] / "checkpoints" / "step_2", ckpt)
    os.remove(ckpt / "model-r00000.safetensors")
    os.mkfifo(ckpt / "model-r00000.safetensors")
    tokens = tmp_path / "tokens"
    shutil.copytree(world["tokens"], tokens)
    os.remove(tokens / "train-00000.npy")
    os.mkfifo(tokens / "train-00000.npy")
    os.mkfifo(tmp_path / "config.toml")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    cfg, run = str(world["config"]), f"--run.dir={tmp_path / 'run'}"
    cases = [(["train", cfg, run, "--train.steps=2", f"--run.resume_from={ckpt}"],
              r"model-r00000.safetensors'? is a FIFO"),
             (["train", cfg, run, "--data.source=tokens", f"--data.path={tokens}"],
              r"train-00000.npy'? is a FIFO"),
             (["train", str(tmp_path / "config.toml"), "--dry-run"], r"config.toml' is a FIFO"),
             (["train", str(world["base"]) + "/", "--dry-run"], r"is a directory, not a regular"),
             (["train", "/dev/zero", "--dry-run"], r"'/dev/zero' is a character device"),
             (["train", str(tmp_path / "loop_a"), "--dry-run"], r"loop_a' is a symlink loop"),
             (["train", str(tmp_path / ("x" * 300)), "--dry-run"], r"has a name too long")]
    if "hf" in world:
        hf = tmp_path / "hf"
        shutil.copytree(world["hf"], hf)
        os.remove(hf / "model.safetensors")
        os.mkfifo(hf / "model.safetensors")
        cases.append((["convert", "--from", "hf", str(hf), "--to", "moepar",
                       str(tmp_path / "out")], r"model.safetensors'? is a FIFO"))
    for (argv, message), (rc, err) in zip(cases, run_cases([a for a, _ in cases]), strict=True):
        assert rc != 0 and "Traceback" not in err and __import__("re").search(message, err), \
            f"{argv}: rc={rc} {err[-1500:]}"


def test_sizes_that_cannot_be_built_are_refused_at_once(world, tmp_path):
    """Class 8: allocator tracebacks and hangs at a real start, in a dry run and in generate."""
    cfg, run = str(world["config"]), f"--run.dir={tmp_path / 'run'}"
    ckpt = tmp_path / "step_2"
    shutil.copytree(world["run"] / "checkpoints" / "step_2", ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["num_layers"] = 10 ** 6
    (ckpt / "state.json").write_text(json.dumps(state))
    rehash(str(ckpt), "state.json")
    cases = [(["train", cfg, run, "--model.vocab_size=1099511627776"], 2,
              r"model.vocab_size=1099511627776 exceeds 16,777,216"),
             (["train", cfg, run, "--model.dim=1048576"], 2, r"model.dim=1048576 exceeds"),
             (["train", cfg, run, f"--model.max_seq_len={2 ** 40}"], 2, r"max_seq_len=\d+ exceeds"),
             (["train", "examples/tiny.toml", "--model.num_layers=9223372036854775807",
               "--dry-run"], 2, r"model.num_layers=9223372036854775807 exceeds 1,024"),
             (["train", cfg, run, "--model.num_experts=16777216"], 2, r"num_experts=16777216"),
             # within every bound, far beyond this machine: the estimate is named
             (["train", cfg, run, "--model.num_layers=1024", "--model.dim=8192",
               "--model.num_experts=64", "--model.moe_ffn_dim=8192", "--model.top_k=2"], 2,
              r"needs at least [\d,.]+ GiB .* and cpu has [\d,.]+ GiB available"),
             (["generate", str(ckpt), "--prompt", "ab", "--device", "cpu"], 1,
              r"state.json: model.num_layers=1000000 exceeds 1,024"),
             (["train", cfg, run, f"--train.seed={2 ** 63}"], 2, r"train.seed=\d+ must be in"),
             (["train", cfg, f"--run.dir={tmp_path}/a\0b"], 2, r"run.dir=.* holds a NUL byte")]
    rows = run_cases([a for a, _, _ in cases], timeout=120)
    for (argv, code, message), (rc, err) in zip(cases, rows, strict=True):
        assert rc == code and __import__("re").search(message, err), f"{argv}: rc={rc} {err}"
    assert not (tmp_path / "run").exists()


# ---- one regression test per class of issue 30 -----------------------------------------------

def copy_step(world, tmp_path, name="step_2"):
    dst = tmp_path / name
    shutil.copytree(world["run"] / "checkpoints" / "step_2", dst)
    return dst


def edit_json(path, change, rehash_in=None):
    obj = json.loads(open(path).read())
    change(obj)
    open(path, "wb").write(dump(obj))
    if rehash_in is not None:
        rehash(str(rehash_in), os.path.basename(path))


def resume_from(world, tmp_path, ckpt, *extra):
    return cli("train", world["config"], f"--run.dir={tmp_path / 'resumed'}", "--train.steps=2",
               f"--run.resume_from={ckpt}", *extra)


def test_class1_deep_nesting_in_a_safetensors_header_and_hf_index(world, tmp_path):
    from moepar.tensorfile import TensorFileError, read_header
    path = tmp_path / "deep.safetensors"
    text = b"[" * 10000 + b"]" * 10000
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(TensorFileError, match="deep.safetensors: the header: nested 10000 levels"):
        read_header(str(path))
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    shutil.copytree(world["hf"], hf)
    (hf / "model.safetensors.index.json").write_bytes(text)
    rc, text = cli("convert", "--from", "hf", hf, "--to", "moepar", tmp_path / "out")
    assert rc == 1 and "model.safetensors.index.json: nested 10000 levels deep" in text


def _rewrite_header(path, change):
    """Rewrites a safetensors file's JSON header with `change` applied (data untouched)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    open(path, "wb").write(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.mark.parametrize("dtype", [["F32"], {"a": "F32"}])
def test_class2_header_dtype_of_the_wrong_kind(world, tmp_path, dtype):
    ckpt = copy_step(world, tmp_path)
    model = ckpt / "model-r00000.safetensors"
    _rewrite_header(model, lambda h: h["embed.weight"].update(dtype=dtype))
    rehash(str(ckpt), model.name)
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 1 and re.search(r"tensor 'embed.weight' has dtype .* not one of F64", text), text


@pytest.mark.parametrize("blocks", [3, None, {"0": "ab"}])
def test_class3_manifest_blocks_of_the_wrong_kind(world, tmp_path, blocks):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "manifest.json",
              lambda m: m["files"]["model-r00000.safetensors"].update(blocks=blocks))
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 2 and "key 'files.model-r00000.safetensors.blocks'" in text, text


@pytest.mark.parametrize("value", ["__inf__", "__1e400__"])
def test_class4_infinite_world_size(world, tmp_path, value):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "manifest.json", lambda m: m.update(world_size=value))
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 2 and "key 'world_size' is inf, expected a whole number" in text, text


@pytest.mark.parametrize("optimizer", [[1], "x"])
def test_class5_index_optimizer_section_of_the_wrong_kind(world, tmp_path, optimizer):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "index.json", lambda i: i.update(optimizer=optimizer), rehash_in=ckpt)
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 1 and "index.json: key 'optimizer' is" in text and "expected an object" in text


@pytest.mark.parametrize("key, value", [("dataset", [1]), ("dataset", {"sources": "x"}),
                                        ("config", {"train": [1]})])
def test_class6_state_sections_of_the_wrong_kind_are_refused_not_skipped(world, tmp_path, key,
                                                                         value):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "state.json", lambda s: s.update({key: value}), rehash_in=ckpt)
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 1 and "state.json: key '" + key in text, text      # silent before: exit 0


def test_class7_rng_of_random_bytes_is_refused_before_the_model_changes(world, tmp_path):
    from moepar.checkpoint import CheckpointError, load_checkpoint
    from moepar.tensorfile import write_tensors
    ckpt = copy_step(world, tmp_path)
    n = torch.get_rng_state().numel()
    noise = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    write_tensors(str(ckpt / "rng-r00000.safetensors"),
                  [("torch_cpu", torch.uint8, (n,), lambda: noise)])
    rehash(str(ckpt), "rng-r00000.safetensors")
    trainer = Trainer(tiny_config(tmp_path / "fresh", "--train.steps=2"), log=quiet)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="holds a 'torch_cpu' RNG state that torch refuses"):
        load_checkpoint(str(ckpt), trainer.engine, optimizer=True)
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    trainer.release()


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", 10 ** 12, r"model.vocab_size=1000000000000 exceeds"),
    ("num_experts", 2 ** 40, r"model.num_experts=1099511627776 exceeds")])
def test_class8_generate_refuses_state_sizes(world, tmp_path, key, value, message):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "state.json", lambda s: s["config"]["model"].update({key: value}),
              rehash_in=ckpt)
    rc, text = cli("generate", ckpt, "--prompt", "ab", "--device", "cpu")
    assert rc == 1 and re.search(message, text) and "state.json" in text, text


def test_class8_hf_context_too_long_to_build(world, tmp_path):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    shutil.copytree(world["hf"], hf)
    edit_json(hf / "config.json", lambda c: c.update(max_position_embeddings=10 ** 15))
    rc, text = cli("convert", "--from", "hf", hf, "--to", "moepar", tmp_path / "out")
    assert rc == 1 and "model.max_seq_len=1000000000000000 exceeds 4,194,304" in text, text


@pytest.mark.parametrize("key, value, message", [
    ("num_nextn_predict_layers", [1], r"num_nextn_predict_layers=\[1\] is not a whole number"),
    ("num_nextn_predict_layers", "x", r"num_nextn_predict_layers='x' is not a whole number"),
    ("quantization_config", [1], r"quantization_config=\[1\] is not an object")])
def test_class10_and_17_hf_config_types(world, tmp_path, key, value, message):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    shutil.copytree(world["hf"], hf)
    edit_json(hf / "config.json", lambda c: c.update({key: value}))
    rc, text = cli("convert", "--from", "hf", hf, "--to", "moepar", tmp_path / "out")
    assert rc == 1 and re.search(message, text) and "config.json" in text, text


@pytest.mark.parametrize("content, message", [
    (b"[1]", r"hf_config.json holds a JSON list"),
    (b'{"model_type": ["mixtral"]}', r"hf_config.json: model_type=\['mixtral'\] is not a string"),
    (b"{not json", r"hf_config.json is not valid JSON")])
def test_class11_and_17_hf_config_beside_a_checkpoint(world, tmp_path, content, message):
    pytest.importorskip("transformers")
    ckpt = tmp_path / "converted"
    shutil.copytree(world["converted"], ckpt)
    (ckpt / "hf_config.json").write_bytes(content)
    rc, text = cli("convert", "--from", "moepar", ckpt, "--to", "hf", tmp_path / "out")
    assert rc == 1 and re.search(r"hf_config.json (does not match its SHA-256|has \d+ bytes, "
                                 r"its manifest says)", text), text       # listed: verified
    rehash(str(ckpt), "hf_config.json")
    rc, text = cli("convert", "--from", "moepar", ckpt, "--to", "hf", tmp_path / "out")
    assert rc == 1 and re.search(message, text), text
    manifest = json.loads((ckpt / "manifest.json").read_text())   # unlisted: not read, said
    del manifest["files"]["hf_config.json"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    rc, text = cli("convert", "--from", "moepar", ckpt, "--to", "hf", tmp_path / "out")
    assert rc == 0 and "hf_config.json is not listed in" in text, text


def test_class12_nan_weights_in_an_hf_folder(world, tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    hf = tmp_path / "hf"
    shutil.copytree(world["hf"], hf)
    tensors = load_file(str(hf / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name][0, 3] = float("nan")
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    rc, text = cli("convert", "--from", "hf", hf, "--to", "moepar", tmp_path / "out")
    assert rc == 1 and f"tensor {name!r} in model.safetensors holds non-finite values" in text
    assert not (tmp_path / "out").exists()
    rc, text = cli("generate", hf, "--prompt", "ab", "--tokenizer", "bytes", "--device", "cpu")
    assert rc == 1 and f"tensor {name!r}" in text, text


def test_class13_run_dir_that_is_a_file_and_lock_that_is_a_directory(world, tmp_path):
    (tmp_path / "file").write_text("mine")
    rc, text = cli("train", world["config"], f"--run.dir={tmp_path / 'file'}")
    assert rc == 2 and "exists and is not a directory" in text
    assert (tmp_path / "file").read_text() == "mine"
    (tmp_path / "run" / "run.lock").mkdir(parents=True)
    rc, text = cli("train", world["config"], f"--run.dir={tmp_path / 'run'}")
    assert rc == 2 and "run.lock is a directory" in text, text
    assert sorted(os.listdir(tmp_path / "run")) == ["run.lock"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "diverged.json"])
def test_class14_infinite_step_on_resume(world, tmp_path, name):
    run_dir = tmp_path / "run"
    shutil.copytree(world["run"], run_dir)
    if name == "diverged.json":
        (run_dir / name).write_text('{"step": Infinity, "reason": "r", "config": {}}')
    else:
        with open(run_dir / name, "a") as f:
            f.write('{"step": Infinity}\n')
    before = tree(str(run_dir))
    rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=3",
                   "--run.resume=true")
    assert rc == 2 and f"{name}" in text and "key 'step' is inf" in text, text
    assert tree(str(run_dir)) == before


def test_class15_a_symlinked_lock_is_never_written_through(world, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / "run.lock")
    rc, text = cli("train", world["config"], f"--run.dir={tmp_path / 'run'}", "--train.steps=1")
    assert rc == 2 and "run.lock is a symlink" in text, text
    assert victim.read_text() == "the user's file\n"
    os.remove(tmp_path / "run" / "run.lock")
    os.link(victim, tmp_path / "run" / "run.lock")       # a hard link: the same file
    rc, text = cli("train", world["config"], f"--run.dir={tmp_path / 'run'}", "--train.steps=1")
    assert rc == 2 and "has other hard links" in text, text
    assert victim.read_text() == "the user's file\n"


def test_class16_a_refused_start_changes_nothing_and_user_folders_are_never_moved(world, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(world["run"], run_dir)
    (run_dir / "checkpoints" / "step_3").mkdir()                 # a user's, no manifest
    (run_dir / "checkpoints" / "step_3" / "notes.txt").write_text("mine")
    (run_dir / "checkpoints" / ".discard-mine").mkdir()
    (run_dir / "checkpoints" / ".discard-mine" / "keep.txt").write_text("mine too")
    before = tree(str(run_dir))
    rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=2")
    assert rc == 2 and "already holds" in text
    assert tree(str(run_dir)) == before
    # A start that goes ahead (resume) still leaves both alone, and says so.
    rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=2",
                   "--run.resume=true")
    assert rc == 0, text
    assert "left step_3 alone" in text and "left .discard-mine alone" in text
    assert (run_dir / "checkpoints" / "step_3" / "notes.txt").read_text() == "mine"
    assert (run_dir / "checkpoints" / ".discard-mine" / "keep.txt").read_text() == "mine too"


def test_class17_messages_name_the_file(world, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(world["config"].read_bytes().replace(b'source = "builtin"',
                                                         b'source = "b\xffuiltin"'))
    rc, text = cli("train", bad, "--dry-run")
    assert rc == 2 and re.search(r"bad.toml': not UTF-8 text \(byte 0xff at line \d+, column", text)
    run_dir = tmp_path / "run"
    shutil.copytree(world["run"], run_dir)
    with open(run_dir / "expert_load.jsonl", "ab") as f:
        f.write(b'{"step": 9, "x": "\xff"}\n')
    rc, text = cli("train", world["config"], f"--run.dir={run_dir}", "--train.steps=3",
                   "--run.resume=true")
    assert rc == 2 and re.search(r"expert_load.jsonl:4: not UTF-8 text", text), text


def _train_on(world, tmp_path, folder):
    return cli("train", world["config"], f"--run.dir={tmp_path / 'run'}", "--train.steps=1",
               "--data.source=tokens", f"--data.path={folder}")


def test_class18_token_folders_contain_their_files_and_are_hash_checked(world, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "tokens"
    shutil.copytree(world["tokens"], folder)
    shutil.copy(folder / "train-00000.npy", outside / "x.npy")
    edit_json(folder / "index.json",
              lambda i: i["splits"]["train"]["shards"][0].update(file="../outside/x.npy"))
    rc, text = _train_on(world, tmp_path, folder)
    assert rc == 1 and "key 'splits.train.shards[0].file' is '../outside/x.npy'" in text, text
    shutil.rmtree(folder)
    shutil.copytree(world["tokens"], folder)
    edit_json(folder / "index.json",
              lambda i: i["splits"]["train"]["shards"][0].update(sha256="0" * 64))
    rc, text = _train_on(world, tmp_path, folder)
    assert rc == 1 and "train-00000.npy does not match its SHA-256" in text, text
    shutil.rmtree(folder)
    shutil.copytree(world["tokens"], folder)
    data = bytearray((folder / "train-00000.npy").read_bytes())
    rng = random.Random(0)
    for _ in range(50):                     # 50 bit flips in the token data, header untouched
        i = rng.randrange(200, len(data))
        data[i] ^= 1 << rng.randrange(8)
    (folder / "train-00000.npy").write_bytes(bytes(data))
    rc, text = _train_on(world, tmp_path, folder)
    assert rc == 1 and "train-00000.npy does not match its SHA-256" in text, text
    shutil.rmtree(folder)
    shutil.copytree(world["tokens"], folder)
    os.symlink(folder / "train-00000.npy", folder / "link.npy")    # a link inside is followed
    edit_json(folder / "index.json",
              lambda i: i["splits"]["train"]["shards"][0].update(file="link.npy"))
    rc, text = _train_on(world, tmp_path / "linked", folder)
    assert rc == 0, text


def test_class18_world_size_without_its_rng_files_is_refused(world, tmp_path):
    ckpt = copy_step(world, tmp_path)
    edit_json(ckpt / "manifest.json", lambda m: m.update(world_size=2))
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 1 and "says world_size=2 but lists the RNG files of ranks [0]" in text, text


def test_class18_swapped_offsets_of_same_shape_tensors_are_refused(world, tmp_path):
    ckpt = copy_step(world, tmp_path)
    a, b = "layers.0.attn.o_proj.weight", "layers.1.attn.o_proj.weight"   # both [32, 32]

    def swap(header):
        header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                                header[a]["data_offsets"])
    _rewrite_header(ckpt / "model-r00000.safetensors", swap)
    rehash(str(ckpt), "model-r00000.safetensors")
    rc, text = resume_from(world, tmp_path, ckpt)
    assert rc == 1 and re.search(r"lies at bytes \[\d+, \d+\] of the data, the index says", text)
