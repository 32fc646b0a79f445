"""The tp router's packed documents without processes: four stand-in slices of one micro-batch
(a token group whose `total` returns the sum of every slice's parts, recorded in a first pass)
give the losses and statistics of the whole micro-batch routed at once, with documents that span
one, two and three slice edges and padding."""

import torch

from moepar.layers import RouterConfig
from moepar.layers.documents import build_documents
from moepar.layers.router import TopKRouter
from moepar.parallel.sequence_router import use_token_group

TP, SEQ, SLICE = 4, 16, 4
DOCUMENTS_BS = torch.tensor([
    [0] * 9 + [1] * 3 + [2] * 2 + [-1] * 2,          # spans edges 1 and 2; one inside; padding
    [0] * 2 + [1] * 14,                              # spans all three edges
    [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3],  # documents on the edges, none across
    [0] * 6 + [1] * 8 + [2] * 2,                     # two documents across edges in one row
])
ROWS = DOCUMENTS_BS.shape[0]


class StandInSlices:
    """Slice `rank` of `size`; `total`: this slice's parts in the first pass (recorded), the sum
    of every slice's recorded parts in the second."""

    def __init__(self, rank, recorded):
        self.rank, self.size, self.recorded = rank, TP, recorded

    def local(self, t_BSX):
        return t_BSX[:, self.rank * SLICE:(self.rank + 1) * SLICE]

    def total(self, t):
        if len(self.recorded) < self.size:
            self.recorded.append(t.detach())
            return t
        return sum(self.recorded)


def _router():
    torch.manual_seed(5)
    return TopKRouter(8, 4, 2, RouterConfig(seq_balance_coeff=0.1, z_coeff=0.01)).double()


def test_slices_of_packed_documents_equal_the_whole_micro_batch():
    docs = build_documents(DOCUMENTS_BS)
    gen = torch.Generator().manual_seed(3)
    x_BSD = torch.randn(ROWS, SEQ, 8, dtype=torch.float64, generator=gen)
    _, want, want_stats = _router()(x_BSD.reshape(-1, 8), SEQ, docs.valid_T, docs.doc_T)
    router, recorded = _router(), []
    for _ in range(2):     # record every slice's parts, then total them
        counts = torch.zeros(4)
        for rank in range(TP):
            use_token_group(router, StandInSlices(rank, recorded))
            x_TD = x_BSD[:, rank * SLICE:(rank + 1) * SLICE].reshape(-1, 8)
            _, got, stats = router(x_TD, SLICE, docs.valid_T, docs.doc_T)
            counts += stats.tokens_per_expert_E
        assert len(recorded) == TP
    assert torch.equal(counts, want_stats.tokens_per_expert_E)
    for name in ("balance", "seq_balance", "z", "total"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-12, atol=0,
                                   msg=name)


def test_documents_cut_by_slice_edges_share_one_number():
    """Inside a slice: numbers below B*s, equal exactly within a document; a document cut by an
    edge: the same number, at or above B*s, on every slice it reaches, one per document."""
    doc_BS = build_documents(DOCUMENTS_BS).doc_T.view(ROWS, SEQ)
    router, batch_slice = _router(), ROWS * SLICE
    numbers = []
    for rank in range(TP):
        use_token_group(router, StandInSlices(rank, []))
        numbers.append(router._slice_documents(doc_BS, SLICE).view(ROWS, SLICE))
    got_BS = torch.cat(numbers, 1)
    for b in range(ROWS):
        for p in range(SEQ):
            for q in range(SEQ):
                same_doc = bool(doc_BS[b, p] == doc_BS[b, q])
                cut = len({i // SLICE for i in range(SEQ) if doc_BS[b, i] == doc_BS[b, p]}) > 1
                assert bool(got_BS[b, p] >= batch_slice) == cut, (b, p)
                if p // SLICE == q // SLICE or cut:
                    assert bool(got_BS[b, p] == got_BS[b, q]) == same_doc, (b, p, q)
    assert int(got_BS.max()) < batch_slice + ROWS * (TP - 1)
