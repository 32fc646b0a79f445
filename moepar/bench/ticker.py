"""The benchmarks' shared progress line: a long benchmark's repeats, on stderr from rank 0."""

import os
import sys
import time

__all__ = ["Ticker"]


class Ticker:
    """Progress of a benchmark's repeats on stderr ('moepar bench train: repeat 3/10, 12 s'), from
    rank 0, at most once every `every_s` seconds: a benchmark done sooner prints nothing. Call it
    after each repeat, outside the timed region. `say` prints a phase at once."""

    def __init__(self, what: str, warmup: int, repeats: int, every_s: float = 2.0,
                 clock=time.monotonic, out=None):
        self.what, self.warmup, self.repeats, self.every_s = what, warmup, repeats, every_s
        self.clock, self.out = clock, out
        self.start = self.last = clock()
        self.quiet = int(os.environ.get("RANK", 0)) != 0

    def label(self, done: int) -> str:
        """'warm-up 1/2' or 'repeat 3/10' after `done` runs in all."""
        if done <= self.warmup:
            return f"warm-up {done}/{self.warmup}"
        return f"repeat {done - self.warmup}/{self.repeats}"

    def say(self, text: str):
        if not self.quiet:
            print(f"moepar bench {self.what}: {text}, {self.clock() - self.start:.0f} s",
                  file=self.out or sys.stderr, flush=True)

    def __call__(self, done: int):
        now = self.clock()
        if now - self.last >= self.every_s or (done == self.warmup + self.repeats
                                                and self.last != self.start):
            self.last = now
            self.say(self.label(done))
