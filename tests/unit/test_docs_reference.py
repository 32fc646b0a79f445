"""The generated blocks of docs/ (the configuration keys, the planner's rules) equal what the code
says today: scripts/docs_reference.py renders them, and a page that differs fails here."""

import importlib.util
import pathlib

import pytest

from moepar.config import config_reference
from moepar.plan.rules import RULES

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_reference",
                                               ROOT / "scripts" / "docs_reference.py")
docs_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_reference)


def test_the_generated_blocks_are_current():
    stale = docs_reference.stale_pages(write=False)
    assert not stale, f"run python scripts/docs_reference.py: out of date: {stale}"


def test_every_config_key_is_a_row_with_its_default():
    """Independent of the renderer's parsing: each `section.key = value` line of the reference
    (what `moepar train --help` prints) is one table row of the page, in the same order."""
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    expected = []
    for line in config_reference().splitlines():
        if "=" in line and not line.strip().startswith("["):
            key, value = (s.strip() for s in line.split("#")[0].split("=", 1))
            expected.append(f"| `{key}` | `{value}` |")
    rows = [line[:line.index("` |", line.index("` | `") + 4) + 3] for line in page.splitlines()
            if line.startswith("| `") and "` | `" in line]
    assert rows == expected


def test_the_planner_page_holds_the_rules_verbatim():
    page = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    assert "```\n" + RULES.rstrip("\n") + "\n```" in page


def test_a_changed_reference_is_reported(tmp_path, monkeypatch):
    """The check itself: a page whose block differs from its source is named (and rewritten)."""
    page = tmp_path / "docs" / "planner.md"
    page.parent.mkdir()
    page.write_text("# Planner\n<!-- generated: plan-rules -->\nold rules\n"
                    "<!-- /generated: plan-rules -->\n", encoding="utf-8")
    monkeypatch.setattr(docs_reference, "ROOT", tmp_path)
    monkeypatch.setattr(docs_reference, "BLOCKS",
                        {"plan-rules": ("docs/planner.md", docs_reference.plan_rules_markdown)})
    assert docs_reference.stale_pages(write=False) == ["docs/planner.md (plan-rules)"]
    assert docs_reference.main(["--check"]) == 1
    assert docs_reference.main([]) == 0
    assert RULES.splitlines()[0] in page.read_text(encoding="utf-8")
    assert docs_reference.stale_pages(write=False) == []


def test_a_page_without_markers_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no '<!-- generated: plan-rules -->'"):
        docs_reference.render("# Planner\n", "plan-rules", "rules")
