"""A2ATimer's split of the exposed all-to-all time, on hand-made clocks."""

import pytest

from moepar.parallel.comm import A2ATimer


def _timer():
    """Two all-to-alls on this rank: a blocking one issued at 0.0 that returned at 1.0, and an
    async one issued at 2.0 (0.1 s to issue), completed at 3.0, waited from 2.5."""
    timer = A2ATimer()
    timer.issue_times = [0.0, 2.0]
    timer.done_times = {0: 1.0, 1: 3.0}
    timer.waits = [(0, 0.0, 1.0), (1, 2.5, 3.0)]
    timer.issuing = 0.1
    return timer


def test_split_parts_exposed_into_peer_wait_and_communication():
    timer = _timer()
    assert timer.total == pytest.approx(2.0)           # [0, 1] and [2, 3]
    assert timer.exposed == pytest.approx(1.6)         # 0.1 issuing + 1.0 + 0.5 blocked
    # The other rank issued the first at 0.4 and the second at 2.7.
    split = timer.split([0.4, 2.7])
    assert split["peer_wait"] == pytest.approx(0.4 + 0.2)
    assert split["comm"] == pytest.approx(1.6 - 0.6)
    assert split["on_wire"] == pytest.approx(0.6 + 0.3)   # [0.4, 1] and [2.7, 3]
    # This rank was the last to issue both: nothing was a wait for a peer.
    split = timer.split([0.0, 2.0])
    assert split["peer_wait"] == 0.0 and split["comm"] == pytest.approx(1.6)
    assert split["on_wire"] == pytest.approx(2.0)


def test_split_refuses_issue_lists_of_other_collectives():
    with pytest.raises(ValueError, match="3 issue times for 2 all-to-alls"):
        _timer().split([0.0, 2.0, 4.0])
