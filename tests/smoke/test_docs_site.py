"""CI builds the documentation site: `mkdocs build --strict` over docs/ and mkdocs.yml, so a
broken link or anchor, a page missing from the nav, or a nav entry without a page fails the
suite (never skips it: mkdocs-material is in the dev extra the test command installs)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def build(tmp_path, config: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")     # material's banner, not our warning
    # No -q: mkdocs then drops the warnings that --strict counts, and a broken link passes.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_the_site_builds_strict(tmp_path):
    done = build(tmp_path, ROOT / "mkdocs.yml")
    assert done.returncode == 0, (
        f"mkdocs build --strict failed (exit {done.returncode}; mkdocs-material comes with "
        f"pip install -e '.[dev]'):\n{done.stdout}\n{done.stderr}")
    site = tmp_path / "site"
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    built = [p for p in pages if (site / ("" if p == "index" else p) / "index.html").is_file()]
    assert built == pages, f"pages without a built page: {sorted(set(pages) - set(built))}"
    # the generated configuration reference made it into the page (a key from the code)
    html = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "train.eval_every" in html and "parallel.a2a_chunks" in html


def test_a_broken_link_fails_the_build(tmp_path):
    """The check itself: the same config over a copy of docs/ with one dead anchor fails."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (ROOT / "docs").glob("*.md"):
        (docs / page.name).write_text(page.read_text(encoding="utf-8"), encoding="utf-8")
    with open(docs / "testing.md", "a", encoding="utf-8") as f:
        f.write("\n[nowhere](configuration.md#no-such-anchor)\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config.write_text(re.sub(r"(?m)^docs_dir: .*$", f"docs_dir: {docs}", text), encoding="utf-8")
    done = build(tmp_path, config)
    assert done.returncode != 0 and "no-such-anchor" in done.stdout + done.stderr, done
