"""`moepar bench checkpoint`: no rank holds more than its shard plus one dense tensor (and a
bounded buffer) while the model is built, saved and loaded, for a model several times larger
than that bound. Measured as each phase's growth of the peak resident set (VmHWM)."""

import json
import subprocess
import sys

MB = 1 << 20


def test_build_save_and_load_stay_within_the_shard(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moepar", "bench", "checkpoint", "--nproc", "4",
                             "--size-gb", "0.4", "--dir", str(tmp_path), "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["world"] == 4 and len(out["ranks"]) == 4
    for r in out["ranks"]:
        slack = 16 * MB      # allocator and Python objects; reads hash 1 MiB at a time
        build_bound = r["shard_bytes"] + r["largest_dense_bytes"] + slack
        # The premise: the whole model is several times what one rank may hold.
        assert out["model_bytes"] > 3 * build_bound, (out["model_bytes"], build_bound)
        assert r["build_peak_bytes"] <= build_bound, r
        # Saving streams one box at a time: no gathered tensor, no whole-file buffer.
        assert r["save_peak_bytes"] <= r["largest_box_bytes"] + slack, r
        # Loading = a build, AdamW state allocated, then one box read at a time.
        held = r["shard_bytes"] + r["optimizer_bytes"]
        assert r["load_peak_bytes"] <= held + r["largest_dense_bytes"] + 2 * slack, r
