"""Packed documents with padding (data.pack='documents', data.pad=true) in dp2 ep2, pp2, tp2,
tp2 ep2 and dp2 tp2 ep4 zero3 layouts equal the single-process run in float64: losses (the mean
over the global batch's counted tokens, whatever rank holds them), grad norms, aux losses,
drops, validation losses and the updated parameters. Under tp, each part of the documents left
out of the tp path (the mask in the sequence-parallel attention, the padding or the documents
in the sequence-parallel router) makes the run differ from one process."""

import math

import pytest
import torch
import torch.distributed as dist

from configs import packed_folder, tiny_config
from moepar.checkpoint import load_checkpoint
from moepar.layers import Transformer
from moepar.parallel.sequence_router import SequenceParallelRouter
from moepar.parallel.tensor import SequenceParallelAttention
from moepar.train import Trainer

STEPS = 2
COMMON = ["--train.dtype=float64", f"--train.steps={STEPS}", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--router.capacity_factor=1.0",
          "--router.bias_update_rate=0.001", "--router.z_coeff=0.001",
          "--router.seq_balance_coeff=0.01", "--run.checkpoint_every=0", "--data.source=tokens",
          "--data.pack=documents", "--data.pad=true", "--train.eval_every=1",
          "--train.eval_batches=1"]


def _records(trainer):
    return [(r["loss"], r["grad_norm"], r["aux_loss"], r["drop_fraction"], r["val_loss"])
            for r in trainer.run()]


def case_train(run_dir: str, data: str, layout: list[str]):
    records = _records(Trainer(tiny_config(run_dir, *COMMON, f"--data.path={data}", *layout),
                               log=lambda _m: None))
    dist.barrier()
    return records


# Mutants of the tp path, each leaving one part of the documents out: attention causal over the
# whole window (positions still per document); padding routed as real tokens; the sequence
# balance loss per row (window) instead of per document.
def _no_mask(self, x_BsD, cos, sin, cache=None, mask=None):
    return _ATTENTION_FORWARD(self, x_BsD, cos, sin, cache)


def _no_padding(self, x_TD, seq_len=None, valid_T=None, doc_T=None, **kwargs):
    return _ROUTER_FORWARD(self, x_TD, seq_len, torch.ones_like(valid_T), doc_T, **kwargs)


def _rows_for_documents(self, x_TD, seq_len=None, valid_T=None, doc_T=None, **kwargs):
    row_len = seq_len * self.token_group.size
    rows_T = torch.arange(doc_T.numel(), device=doc_T.device) // row_len
    return _ROUTER_FORWARD(self, x_TD, seq_len, valid_T, rows_T, **kwargs)


_ATTENTION_FORWARD = SequenceParallelAttention.forward
_ROUTER_FORWARD = SequenceParallelRouter.forward
MUTANTS = {"no_mask": (SequenceParallelAttention, _no_mask),
           "padding_routed": (SequenceParallelRouter, _no_padding),
           "balance_per_row": (SequenceParallelRouter, _rows_for_documents)}


def case_train_mutant(run_dir: str, data: str, mutant: str):
    cls, forward = MUTANTS[mutant]
    original, cls.forward = cls.forward, forward
    try:
        return case_train(run_dir, data, ["--parallel.tp=2"])
    finally:
        cls.forward = original


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # Documents of 9 to 45 bytes in windows of 32: padding, cut documents and several per row.
    # A fifth of the documents held out: validation (eval_every=1) follows the same rules.
    return packed_folder(tmp_path_factory.mktemp("packed_docs"), 100, val_fraction=0.2)


@pytest.fixture(scope="module")
def references(tmp_path_factory, data):
    """The single-process run of a model variant (extra overrides), once per variant."""
    runs = {}

    def get(variant: tuple[str, ...] = ()):
        if variant not in runs:
            ref = Trainer(tiny_config(tmp_path_factory.mktemp("ref"), *COMMON, *variant,
                                      f"--data.path={data}"), log=lambda _m: None)
            runs[variant] = ref, _records(ref)
        return runs[variant]
    return get


@pytest.fixture(scope="module")
def single(references):
    return references()


MLA = ("--model.attention=mla", "--model.kv_lora_rank=16", "--model.q_lora_rank=16",
       "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=8", "--model.v_head_dim=8")
# Deferred balance parts (all layers, counts over dp and the step's micro-batches) under tp.
GLOBAL_BALANCE = ("--router.balance_loss=all_layers", "--router.balance_scope=global")


@pytest.mark.parametrize("layout, variant", [
    pytest.param(["--parallel.ep=2"], (), id="ep2"),
    pytest.param(["--parallel.pp=2"], (), id="pp2"),
    pytest.param(["--parallel.tp=2"], (), id="tp2"),
    pytest.param(["--parallel.tp=2", "--parallel.ep=2"], (), id="tp2-ep2"),
    pytest.param(["--parallel.tp=2"], MLA, id="tp2-mla"),
    # attention recompute passes the mask positionally into the sequence-parallel attention
    pytest.param(["--parallel.tp=2", "--train.recompute=attention"], (), id="tp2-recompute"),
    pytest.param(["--parallel.tp=2", "--parallel.ep=2"], GLOBAL_BALANCE, id="tp2-ep2-global"),
    pytest.param(["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=4", "--parallel.zero=3"],
                 (), id="dp2-tp2-ep4-zero3")])
def test_packed_layout_equals_one_process(worlds, tmp_path, data, references, layout, variant):
    ref, want = references(variant)
    run_dir = str(tmp_path / "run")
    size = 4 if "--parallel.dp=2" in layout else 2    # dp is the world over the rest
    for got in worlds(size).run(case_train, run_dir, data, [*layout, *variant], timeout=120):
        for step, (g_rec, w_rec) in enumerate(zip(got, want, strict=True), 1):
            for g, w in zip(g_rec, w_rec, strict=True):
                assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (step, g_rec, w_rec)
    model = Transformer(ref.cfg.model, ref.cfg.router).double()
    load_checkpoint(f"{run_dir}/checkpoints/step_{STEPS}", model)
    for (name, p), q in zip(model.state_dict().items(), ref.model.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_documents_left_out_of_tp_differ(worlds, tmp_path, data, single, mutant):
    _, want = single
    for got in worlds(2).run(case_train_mutant, str(tmp_path / "run"), data, mutant, timeout=120):
        assert not all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12)
                       for g_rec, w_rec in zip(got, want, strict=True)
                       for g, w in zip(g_rec, w_rec, strict=True)), (mutant, got, want)
