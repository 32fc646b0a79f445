"""Run config: TOML loading, `--section.key` overrides, the TOML round trip, and error messages.

    python -m pytest tests/unit/test_config.py -q
"""

import re

import pytest

from moepar.config import (DataConfig, ParallelConfig, RunConfig, TrainConfig, load_config,
                           parse_overrides, to_toml)
from moepar.layers.model import ModelConfig
from moepar.layers.router import RouterConfig


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


BASE = """
[model]
dim = 64
num_heads = 4
num_kv_heads = 2
num_experts = 8
top_k = 2
max_seq_len = 64

[router]
capacity_factor = 1.25
drop_policy = "position"

[train]
steps = 7
micro_batch_size = 2
global_batch_size = 8
seq_len = 32
lr = 1e-3
"""


# ---- loading and overrides -----------------------------------------------------------------

def test_defaults_without_file():
    assert load_config() == RunConfig()


def test_load_from_toml(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert (cfg.model.dim, cfg.model.num_experts, cfg.model.max_seq_len) == (64, 8, 64)
    assert cfg.router.capacity_factor == 1.25 and cfg.router.drop_policy == "position"
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.global_batch_size) == (7, 2, 8)
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.num_micro_batches == 4
    # Keys not in the file keep their dataclass defaults.
    assert cfg.model.num_layers == ModelConfig().num_layers
    assert cfg.parallel == ParallelConfig()


def test_overrides_both_forms_and_beat_file(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["--model.dim=32", "--train.steps", "11",
                             "--router.norm_topk_prob=true", "--train.lr", "0.5",
                             "--run.dir=out/x", "--router.drop_policy", "probs"])
    assert cfg.model.dim == 32                # file said 64
    assert cfg.train.steps == 11              # file said 7
    assert cfg.router.drop_policy == "probs"  # file said "position"
    assert cfg.router.norm_topk_prob is True
    assert cfg.train.lr == 0.5
    assert cfg.run.dir == "out/x"
    assert cfg.model.num_experts == 8         # untouched file value


def test_overrides_without_file():
    cfg = load_config(None, ["--model.num_experts=4", "--model.top_k", "1"])
    assert (cfg.model.num_experts, cfg.model.top_k) == (4, 1)


def test_parse_overrides_tree():
    assert parse_overrides(["--model.dim=64", "--train.steps", "5", "--model.top_k=1"]) == \
        {"model": {"dim": "64", "top_k": "1"}, "train": {"steps": "5"}}
    assert parse_overrides(["--run.dir=a=b"]) == {"run": {"dir": "a=b"}}  # split on first '='


@pytest.mark.parametrize("bad", [["model.dim=3"], ["--dim=3"], ["--model.dim"]])
def test_bad_override_syntax(bad):
    with pytest.raises(ValueError, match=re.escape(bad[0])):
        load_config(None, bad)


@pytest.mark.parametrize("text", ["none", "None", "NONE"])
def test_capacity_factor_none_override(tmp_path, text):
    cfg = load_config(write(tmp_path, BASE), [f"--router.capacity_factor={text}"])
    assert cfg.router.capacity_factor is None


def test_capacity_factor_none_in_file(tmp_path):
    cfg = load_config(write(tmp_path, '[router]\ncapacity_factor = "none"\n'))
    assert cfg.router.capacity_factor is None


def test_bool_and_int_conversions(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nactivation_checkpointing = true\nlr = 1\n"),
                      ["--run.tensorboard=0", "--router.routed_scaling_factor=2"])
    assert cfg.train.activation_checkpointing is True
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.run.tensorboard is False
    assert cfg.router.routed_scaling_factor == 2.0


def test_example_config_loads():
    cfg = load_config("examples/tiny.toml")
    assert cfg.router.capacity_factor == 1.25 and cfg.model.first_k_dense == 1


# ---- round trip ----------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    [],
    ["--router.capacity_factor=none", "--router.type=topk"],
    ["--router.type=expert_choice", "--router.score_func=sigmoid", "--train.eps=1e-12",
     "--train.dtype=float64", "--model.rope_theta=500000.0", "--run.tensorboard=false"],
])
def test_to_toml_round_trip(tmp_path, extra):
    text_file = write(tmp_path, "hello", name="corpus.txt")
    cfg = load_config(write(tmp_path, BASE), extra + [
        "--data.source=text", f"--data.path={text_file}",
        '--run.dir=runs/a "quoted" dir\\x'])   # quotes and a backslash must survive
    assert cfg.run.dir == 'runs/a "quoted" dir\\x'
    again = load_config(write(tmp_path, to_toml(cfg), name="resolved.toml"))
    assert again == cfg
    # And the default config too.
    assert load_config(write(tmp_path, to_toml(RunConfig()), name="d.toml")) == RunConfig()


@pytest.mark.parametrize("run_dir", ["runs/a\nb", "runs/a\x01b"])
def test_to_toml_round_trip_control_characters(tmp_path, run_dir):
    cfg = load_config(None, [f"--run.dir={run_dir}"])
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg


# ---- errors --------------------------------------------------------------------------------

def test_unknown_section(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config section \[optim\].*model, router"):
        load_config(write(tmp_path, "[optim]\nlr = 1.0\n"))
    with pytest.raises(ValueError, match=r"\[optim\]"):
        load_config(None, ["--optim.lr=1"])


def test_unknown_key_names_key_and_lists_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"'model\.hidden'") as e:
        load_config(write(tmp_path, "[model]\nhidden = 3\n"))
    for allowed in ("vocab_size", "dim", "num_experts", "top_k", "init_std"):
        assert allowed in str(e.value)
    with pytest.raises(ValueError, match=r"'train\.step'.*steps"):
        load_config(None, ["--train.step=3"])


@pytest.mark.parametrize("override, key", [
    ("--model.dim=abc", "model.dim"),
    ("--model.dim=2.5", "model.dim"),
    ("--train.lr=fast", "train.lr"),
    ("--train.activation_checkpointing=maybe", "train.activation_checkpointing"),
    ("--model.num_experts=none", "model.num_experts"),   # only optional fields take none
    ("--router.capacity_factor=lots", "router.capacity_factor"),
])
def test_wrong_type_names_key(override, key):
    with pytest.raises(ValueError, match=re.escape(key) + ".*not a valid"):
        load_config(None, [override])


@pytest.mark.parametrize("toml, key", [
    ("[model]\ndim = \"big\"\n", "model.dim"),
    ("[model]\ndim = true\n", "model.dim"),
    ("[train]\nlr = [1, 2]\n", "train.lr"),
    ("[run]\ndir = 3.5e0\ntensorboard = 1\n", "run.tensorboard"),
])
def test_wrong_type_in_file_names_key(tmp_path, toml, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        load_config(write(tmp_path, toml))


def test_section_not_a_table(tmp_path):
    with pytest.raises(ValueError, match=r"\[model\]"):
        load_config(write(tmp_path, "model = 3\n"))


@pytest.mark.parametrize("override, key, allowed", [
    ("--router.score_func=relu", "router.score_func", ["softmax", "sigmoid"]),
    ("--router.type=hash", "router.type", ["topk", "expert_choice"]),
    ("--router.drop_policy=random", "router.drop_policy", ["probs", "position"]),
    ("--train.dtype=half", "train.dtype", ["float32", "bfloat16", "float16", "float64"]),
    ("--train.on_nonfinite=ignore", "train.on_nonfinite", ["skip", "stop"]),
    ("--model.activation=relu", "model.activation", ["swiglu", "gelu"]),
    ("--data.source=web", "data.source", ["builtin", "text", "tokens"]),
    ("--data.token_dtype=int8", "data.token_dtype", ["uint8", "uint16", "int32", "int64"]),
    ("--parallel.zero=4", "parallel.zero", ["0, 1, 2, 3"]),
])
def test_bad_choice_names_allowed_values(override, key, allowed):
    with pytest.raises(ValueError, match=re.escape(key)) as e:
        load_config(None, [override])
    for value in allowed:
        assert value in str(e.value)


def test_global_batch_not_multiple_of_micro_batch():
    with pytest.raises(ValueError, match=r"train\.global_batch_size=10.*train\.micro_batch_size=4"):
        load_config(None, ["--train.micro_batch_size=4", "--train.global_batch_size=10"])


def test_seq_len_beyond_max_seq_len():
    with pytest.raises(ValueError, match=r"train\.seq_len=300.*model\.max_seq_len=256"):
        load_config(None, ["--train.seq_len=300"])
    assert load_config(None, ["--train.seq_len=256"]).train.seq_len == 256   # boundary is allowed


def test_num_experts_not_divisible_by_n_group():
    with pytest.raises(ValueError, match=r"model\.num_experts=8.*router\.n_group=3"):
        load_config(None, ["--router.n_group=3", "--router.topk_group=1"])


def test_topk_group_bounds():
    with pytest.raises(ValueError, match=r"router\.topk_group=5"):
        load_config(None, ["--router.n_group=4", "--router.topk_group=5"])
    # 4 groups of 2, one group allowed: only 2 experts reachable, top_k 3 cannot be met.
    with pytest.raises(ValueError, match=r"model\.top_k=3.*router\.topk_group=1"):
        load_config(None, ["--router.n_group=4", "--router.topk_group=1", "--model.top_k=3"])


def test_top_k_above_num_experts():
    with pytest.raises(ValueError, match=r"model\.top_k=9.*model\.num_experts=8"):
        load_config(None, ["--model.top_k=9"])
    with pytest.raises(ValueError, match=r"model\.top_k=3"):
        RouterConfig().check_experts(num_experts=2, top_k=3)


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match=r"model\.num_heads=4.*model\.num_kv_heads=3"):
        load_config(None, ["--model.num_kv_heads=3"])


def test_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"model\.dim=100.*model\.num_heads=3"):
        load_config(None, ["--model.dim=100", "--model.num_heads=3", "--model.num_kv_heads=1"])


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.tp=3", "--model.num_heads=4"], "model.num_heads=4 must be divisible by parallel.tp=3"),
    (["--parallel.tp=4", "--model.num_heads=12", "--model.num_kv_heads=6", "--model.dim=96"],
     "model.num_kv_heads=6 and parallel.tp=4: one must divide the other"),
    (["--parallel.tp=2", "--train.seq_len=33", "--model.max_seq_len=64"],
     "train.seq_len=33 must be divisible by parallel.tp=2"),
    (["--parallel.tp=2", "--router.type=expert_choice", "--router.capacity_factor=1.0"],
     "router.type='expert_choice' with parallel.tp=2"),
])
def test_tensor_parallel_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.pp=2", "--model.num_layers=3", "--parallel.pp_layers=2,2"],
     "parallel.pp_layers=[2, 2] sums to 4, but model.num_layers=3"),
    (["--parallel.pp=2", "--model.num_layers=4", "--parallel.pp_layers=[4]"],
     "parallel.pp_layers=[4] has 1 entries"),
    (["--parallel.pp=4", "--model.num_layers=3"], "model.num_layers=3 is fewer than the stage chunks"),
    (["--parallel.pp=2", "--parallel.pp_virtual=2"], "needs parallel.pp_schedule='interleaved_1f1b'"),
    (["--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"],
     "parallel.pp_virtual=2 needs parallel.pp > 1"),
    (["--parallel.pp=2", "--model.num_layers=2", "--model.tie_embeddings=true"],
     "model.tie_embeddings=true with parallel.pp=2"),
    (["--parallel.pp_schedule=zigzag"], "parallel.pp_schedule='zigzag' is not one of"),
])
def test_pipeline_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.zero=4"], "parallel.zero=4 is not one of 0, 1, 2, 3"),
    (["--parallel.grad_reduce_dtype=int8"], "parallel.grad_reduce_dtype='int8' is not one of"),
    (["--parallel.grad_reduce_dtype=float16"], "without loss scaling; use 'bfloat16'"),
])
def test_zero_and_wire_dtype_checked(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


def test_zero_stages_and_wire_dtype_accepted():
    cfg = load_config(None, ["--parallel.zero=3", "--parallel.grad_reduce_dtype=bfloat16"])
    assert (cfg.parallel.zero, cfg.parallel.grad_reduce_dtype) == (3, "bfloat16")


def test_expert_and_data_parallel_degrees_accepted_and_checked_against_experts():
    cfg = load_config(None, ["--parallel.ep=4", "--parallel.dp=4", "--model.num_experts=8"])
    assert (cfg.parallel.ep, cfg.parallel.dp) == (4, 4)
    with pytest.raises(ValueError, match=r"model\.num_experts=6.*parallel\.ep=4"):
        load_config(None, ["--parallel.ep=4", "--model.num_experts=6", "--model.top_k=2"])


def test_parallel_degree_below_one():
    with pytest.raises(ValueError, match=r"parallel\.ep=0"):
        ParallelConfig(ep=0)


def test_text_source_needs_existing_path(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source='text' needs data\.path"):
        load_config(None, ["--data.source=text"])
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"data\.path=.*nope\.txt.*not a file"):
        load_config(None, ["--data.source=text", f"--data.path={missing}"])
    with pytest.raises(ValueError, match=r"data\.path"):
        DataConfig(source="tokens", path=str(tmp_path))   # a directory is not a file


def test_small_vocab_refused_for_byte_data():
    with pytest.raises(ValueError, match=r"model\.vocab_size=100"):
        load_config(None, ["--model.vocab_size=100"])


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[model\ndim = = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "absent.toml"))


@pytest.mark.parametrize("kwargs, key", [
    (dict(capacity_factor=0.0), "router.capacity_factor"),
    (dict(type="expert_choice"), "router.capacity_factor"),
    (dict(balance_coeff=-1.0), "router.balance_coeff"),
    (dict(routed_scaling_factor=0.0), "router.routed_scaling_factor"),
])
def test_router_config_checks(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        RouterConfig(**kwargs)


@pytest.mark.parametrize("kwargs, key", [
    (dict(steps=0), "train.steps"),
    (dict(lr=0.0), "train.lr"),
    (dict(beta2=1.0), "train.beta2"),
    (dict(grad_clip=-1.0), "train.grad_clip"),
])
def test_train_config_checks(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        TrainConfig(**kwargs)



def test_space_separated_override_does_not_swallow_the_next_flag():
    with pytest.raises(ValueError, match="--run.dir"):
        load_config(None, ["--run.dir", "--train.steps=3"])


@pytest.mark.parametrize("override, key", [
    ("--router.balance_coeff=nan", "router.balance_coeff"),
    ("--router.routed_scaling_factor=nan", "router.routed_scaling_factor"),
    ("--router.capacity_factor=inf", "router.capacity_factor"),
    ("--train.grad_clip=nan", "train.grad_clip"),
    ("--train.weight_decay=inf", "train.weight_decay"),
    ("--train.lr=inf", "train.lr"),
    ("--model.init_std=-1", "model.init_std"),
    ("--model.norm_eps=0", "model.norm_eps"),
    ("--model.rope_theta=nan", "model.rope_theta"),
])
def test_non_finite_or_out_of_range_numbers_refused(override, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, named", [
    (["--parallel.backend=gloo", "--train.device=cuda"], "gloo"),
    (["--parallel.backend=nccl", "--train.device=cpu"], "nccl"),
])
def test_backend_device_mismatch_refused(overrides, named):
    with pytest.raises(ValueError, match=f"parallel.backend='{named}'"):
        load_config(None, overrides)


def test_errors_name_where_the_key_came_from(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: unknown config key 'model.dimm'"):
        load_config(str(path))
    path.write_text("[model]\ndim = 32\n")
    with pytest.raises(ValueError, match=r"^command line: unknown config key 'model.dimm'"):
        load_config(str(path), ["--model.dimm=3"])
    with pytest.raises(ValueError, match=r"^command line: unknown config section \[modle\]"):
        load_config(str(path), ["--modle.dim=3"])
