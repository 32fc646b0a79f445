"""AdamW with bfloat16 moments (train.optim_state_dtype, parallel/adamw.py): torch's arithmetic
exactly when the moments are float32, a float64 hand-written AdamW within bf16 rounding when
they are bf16, half the state bytes, and checkpoints that keep the moments in their dtype."""

import json

import pytest
import torch

from configs import tiny_config
from moepar.config import load_config
from moepar.parallel import adamw as adamw_module
from moepar.parallel.adamw import AdamW, adamw_update
from moepar.rundir import RunDirError
from moepar.train import Trainer

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def quiet(_msg):
    pass


def draws(steps: int, seed: int = 0):
    """Initial values of a matrix and a vector, and `steps` gradients of each."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
             for _ in range(steps)]
    return init, grads


def run(optimizer_of, init, grads, dtype=torch.float32):
    params = [torch.nn.Parameter(t.to(dtype)) for t in init]
    opt = optimizer_of([{"params": params[:1], "weight_decay": WD},
                        {"params": params[1:], "weight_decay": 0.0}])
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


def reference_adamw(init, grads):
    """Decoupled-weight-decay Adam in float64, written out from the paper (Loshchilov & Hutter)."""
    params = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    for t, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            wd = WD if i == 0 else 0.0
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            m_hat, v_hat = m[i] / (1 - BETAS[0] ** t), v[i] / (1 - BETAS[1] ** t)
            params[i] = params[i] * (1 - LR * wd) - LR * m_hat / (v_hat.sqrt() + EPS)
    return params, m, v


def torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)


def ours(state_dtype):
    return lambda groups: AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True,
                                state_dtype=state_dtype)


def test_float32_moments_are_torch_adamw_bit_for_bit():
    init, grads = draws(6)
    want, want_opt = run(torch_adamw, init, grads)
    # The class with float32 moments (what train.optim_state_dtype = "float32" builds) ...
    got, _ = run(ours(None), init, grads)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # ... and the low-precision path's own arithmetic, given float32 moments.
    params = [t.to(torch.float32).clone() for t in init]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, 1):
        for i, g in enumerate(step_grads):
            adamw_update([params[i]], [g.float()], [m[i]], [v[i]], [float(t)], lr=LR,
                         beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD if i == 0 else 0.0,
                         eps=EPS)
    for p, q in zip(params, want, strict=True):
        assert torch.equal(p, q)
    state = [want_opt.state[q] for q in want]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(m, state, strict=True))
    assert all(torch.equal(a, s["exp_avg_sq"]) for a, s in zip(v, state, strict=True))


def test_bfloat16_moments_match_a_float64_adamw_within_bf16_rounding():
    init, grads = draws(8)
    want, want_m, want_v = reference_adamw(init, grads)
    got, opt = run(ours(torch.bfloat16), init, grads)
    fp32, _ = run(ours(None), init, grads)
    for p, ref, m_ref, v_ref, exact in zip(got, want, want_m, want_v, fp32, strict=True):
        state = opt.state[p]
        assert p.dtype == torch.float32
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        # bf16 keeps 8 significant bits: each stored moment is within a few 2^-9 of the exact
        # one (rounding accumulates over the steps' decay), and so is each step's update.
        torch.testing.assert_close(state["exp_avg"].double(), m_ref, rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v_ref, rtol=2e-2, atol=1e-4)
        torch.testing.assert_close(p.double(), ref, rtol=0, atol=8 * LR * 2e-2)
        # float32 moments are far closer: the tolerance above is bf16's, not slack
        torch.testing.assert_close(exact.double(), ref, rtol=0, atol=1e-5)
        assert not torch.equal(p, exact)


def test_chunks_do_not_change_the_result(monkeypatch):
    init, grads = draws(3)
    whole, _ = run(ours(torch.bfloat16), init, grads)
    monkeypatch.setattr(adamw_module, "CHUNK", 4)     # the 7x5 matrix in 9 pieces
    pieces, opt = run(ours(torch.bfloat16), init, grads)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces, strict=True))
    assert all(float(opt.state[p]["step"]) == 3 for p in pieces)   # counted once per step


def test_fused_or_amsgrad_with_bf16_moments_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not with fused, capturable, amsgrad or maximize"):
        AdamW([p], amsgrad=True, state_dtype=torch.bfloat16)


def test_config_key_is_validated():
    with pytest.raises(ValueError, match=r"train.optim_state_dtype='float16' is not one of "
                                         r"\('float32', 'bfloat16'\)"):
        load_config(None, ["--train.optim_state_dtype=float16"])


def state_bytes(trainer) -> int:
    state = getattr(trainer.optimizer, "inner", trainer.optimizer).state
    return sum(s[k].numel() * s[k].element_size() for s in state.values()
               for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_state_bytes_halve(tmp_path, dtype):
    base = Trainer(tiny_config(tmp_path / "a", f"--train.dtype={dtype}"), log=quiet)
    half = Trainer(tiny_config(tmp_path / "b", f"--train.dtype={dtype}",
                               "--train.optim_state_dtype=bfloat16"), log=quiet)
    for trainer in (base, half):
        trainer.train_step()
    numel = sum(p.numel() for p in base.model.parameters())
    assert state_bytes(base) == 8 * numel
    assert state_bytes(half) == 4 * numel


ARGS = ["--train.dtype=bfloat16", "--train.optim_state_dtype=bfloat16", "--train.steps=3",
        "--run.checkpoint_every=2", "--run.keep_checkpoints=0"]


def test_bf16_moments_are_checkpointed_as_bf16_and_resume_bit_exactly(tmp_path):
    whole = Trainer(tiny_config(tmp_path / "a", *ARGS), log=quiet)
    last = whole.run()[-1]
    step2 = tmp_path / "a" / "checkpoints" / "step_2"
    index = json.loads((step2 / "index.json").read_text())["optimizer"]
    dtypes = {name.split("/")[0]: entry["dtype"] for name, entry in index.items()}
    assert dtypes == {"exp_avg": "BF16", "exp_avg_sq": "BF16", "step": "F32"}
    resumed = Trainer(tiny_config(tmp_path / "b", *ARGS, f"--run.resume_from={step2}"),
                      log=quiet)
    record = resumed.train_step()
    assert (record["loss"], record["grad_norm"]) == (last["loss"], last["grad_norm"])
    for p, q in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(whole.engine.masters.master(p), resumed.engine.masters.master(q))
        a, b = whole.optimizer.state[whole.engine.masters.master(p)], \
            resumed.optimizer.state[resumed.engine.masters.master(q)]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["exp_avg"].dtype == torch.bfloat16


def test_resuming_with_another_moment_dtype_converts_when_allowed(tmp_path):
    """A change of train.optim_state_dtype is refused like any change of the optimization,
    unless run.allow_changes names it; then the stored moments are converted on load
    (bf16 -> float32 exactly; float32 -> bf16 rounds to nearest)."""
    Trainer(tiny_config(tmp_path / "a", *ARGS), log=quiet).run()
    step3 = tmp_path / "a" / "checkpoints" / "step_3"
    other = [a for a in ARGS if "optim_state_dtype" not in a] + ["--train.steps=4",
                                                                  f"--run.resume_from={step3}"]
    with pytest.raises(RunDirError, match="train.optim_state_dtype 'bfloat16' -> 'float32'"):
        Trainer(tiny_config(tmp_path / "b", *other), log=quiet)
    same = Trainer(tiny_config(tmp_path / "c", *ARGS[:-3], "--train.steps=4",
                               f"--run.resume_from={step3}"), log=quiet)
    wide = Trainer(tiny_config(tmp_path / "d", *other,
                               "--run.allow_changes=train.optim_state_dtype"), log=quiet)
    narrow_moments, _ = same.engine.optimizer_shards()
    wide_moments, _ = wide.engine.optimizer_shards()
    for a, b in zip(narrow_moments, wide_moments, strict=True):
        assert a.tensor.dtype == torch.bfloat16 and b.tensor.dtype == torch.float32
        assert torch.equal(a.tensor.float(), b.tensor), a.name
    assert not wide.train_step()["skipped"]
