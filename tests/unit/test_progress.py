"""The progress line: tok/s over the logging window, elapsed time and ETA, by hand."""

import pytest

from moepar.progress import Progress, count_text, duration, params_text

RECORD = {"loss": 4.0, "aux_loss": 0.01, "z_loss": 1e-4, "grad_norm": 0.5, "lr": 1e-3,
          "max_load_ratio": 1.5, "drop_fraction": 0.02, "tokens_per_s": 1.0}


def rec(step: int) -> dict:
    return {**RECORD, "step": step}


def test_duration():
    assert [duration(s) for s in (0, 41.4, 41.6, 164, 3600 + 61, 100 * 3600, -3)] == \
        ["0:00:00", "0:00:41", "0:00:42", "0:02:44", "1:01:01", "100:00:00", "0:00:00"]


def test_window_rate_elapsed_and_eta_by_hand():
    # 2048 tokens per step; starts at step 0 at t=100 s
    p = Progress(total_steps=200, tokens_per_step=2048, start_step=0, now=100.0)
    # step 1 at t=103: 1 step, 2048 tokens in 3 s = 682.67 tok/s; 199 steps left at 1/3 step/s
    line = p.line(rec(1), 103.0)
    assert "0.7k tok/s" in line and "0:00:03 elapsed, eta 0:09:57" in line
    # step 10 at t=112: 9 steps in 9 s since the last line (not since the start, not one step)
    assert p.window(10, 112.0) == (9 * 2048 / 9, 190.0)
    line = p.line(rec(10), 112.0)
    assert "2.0k tok/s" in line and "0:00:12 elapsed, eta 0:03:10" in line
    # step 40 at t=141: 30 steps in 29 s -> 2118.6 tok/s; eta 160 steps * 29/30 s = 154.67 s
    line = p.line(rec(40), 141.0)
    assert line.startswith("step    40/200 | loss 4.0000 |")
    assert line.endswith("| 2.1k tok/s | load max/mean 1.50 | drop 2.0% | "
                         "0:00:41 elapsed, eta 0:02:35")


def test_a_resumed_run_counts_from_its_own_start():
    p = Progress(total_steps=100, tokens_per_step=1000, start_step=50, now=0.0)
    tokens_per_s, eta = p.window(60, 20.0)     # 10 steps in 20 s; 40 left
    assert (tokens_per_s, eta) == (500.0, 80.0)
    assert p.line(rec(100), 100.0).endswith("0:01:40 elapsed, eta 0:00:00")


def test_an_empty_window_has_no_eta():
    p = Progress(total_steps=10, tokens_per_step=1, start_step=3, now=5.0)
    assert p.window(3, 5.0) == (0.0, None)
    assert p.line(rec(3), 5.0).endswith("0.0k tok/s | load max/mean 1.50 | drop 2.0% | "
                                        "0:00:00 elapsed, eta ?")


@pytest.mark.parametrize("n, text", [(999, "999"), (2_822_272, "2.82M"),
                                     (46_702_792_704, "46.70B"), (1_500, "1.50k"),
                                     (1.2e12, "1.20T")])
def test_count_text(n, text):
    assert count_text(n) == text


def test_params_text():
    assert params_text({"total": 2_822_272, "active": 1_052_800}) == \
        "parameters: 2,822,272 total (2.82M), 1,052,800 active per token (1.05M)"


def test_bench_ticker_prints_at_most_every_interval_to_its_stream(monkeypatch):
    """A benchmark's progress: nothing for a quick one; for a slow one a line at most every
    2 s, and the last repeat once anything was printed; never from a rank other than 0."""
    import io

    from moepar.bench import Ticker
    monkeypatch.delenv("RANK", raising=False)
    clock = iter([0.0, 0.5, 1.0, 1.5]).__next__    # start, then after each of 3 runs
    out = io.StringIO()
    tick = Ticker("train", warmup=1, repeats=2, clock=clock, out=out)
    for done in (1, 2, 3):
        tick(done)
    assert out.getvalue() == ""                   # done in 1.5 s: silent
    times = [0.0, 1.0, 2.5, 3.0, 3.5, 4.0, 4.2, 4.3]   # start, each call, each say()
    clock = iter(times).__next__
    tick = Ticker("train", warmup=2, repeats=3, clock=clock, out=out)
    for done in (1, 2, 3, 4, 5):
        tick(done)
    assert out.getvalue().splitlines() == [
        "moepar bench train: warm-up 2/2, 3 s",     # at 2.5 s; say() reads the clock at 3.0
        "moepar bench train: repeat 3/3, 4 s"]      # the last one, though 2 s have not passed
    monkeypatch.setenv("RANK", "1")
    quiet = io.StringIO()
    Ticker("train", 0, 1, every_s=0.0, out=quiet)(1)
    assert quiet.getvalue() == ""
