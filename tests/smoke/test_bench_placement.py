"""`moepar bench placement` through the real CLI: under a skewed load the balanced placement
moves rows off the busiest EP rank, and every routed copy is still computed exactly once."""

import json
import subprocess
import sys


def test_balanced_placement_evens_the_rows():
    ep, tokens, top_k = 2, 64, 2
    out = subprocess.run([sys.executable, "-m", "moepar", "bench", "placement", "--ep", str(ep),
                          "--tokens", str(tokens), "--dim", "16", "--ffn-dim", "32",
                          "--experts", "4", "--top-k", str(top_k), "--skew", "0.5",
                          "--replicas", "1", "--repeats", "1", "--warmup", "0", "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    for name in ("contiguous", "balanced"):     # dropless: tokens * top_k rows per rank, moved
        assert sum(result[name]["rows_per_rank"]) == ep * tokens * top_k, result
    assert sum(result["load_E"]) == ep * tokens * top_k
    assert result["balanced"]["max_over_mean"] < result["contiguous"]["max_over_mean"], result
    owned = sorted(e for rank in result["placement"] for e in rank[:2])
    assert owned == [0, 1, 2, 3], result["placement"]      # each expert owned once
