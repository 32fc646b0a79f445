"""Writes the generated blocks of docs/ from the code's own reference texts, so the pages cannot drift:

    python scripts/docs_reference.py           # rewrite every generated block in place
    python scripts/docs_reference.py --check   # exit 1, naming the pages, when one differs

| block (between `<!-- generated: NAME -->` and `<!-- /generated: NAME -->`) | page | source |
|---|---|---|
| config-reference | docs/configuration.md | `moepar.config.config_reference()` (what `moepar train --help` prints) |
| plan-rules | docs/planner.md | `moepar.plan.rules.RULES` (what `moepar plan --explain` prints) |

tests/unit/test_docs_reference.py runs the check, so a changed default, comment or rule fails CI
until this script is run. A generator script rather than an mkdocs hook: the page in the
repository is then the page a reader sees on GitHub too.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def config_reference_markdown() -> str:
    """`config_reference()` as one table per section: key, default, meaning."""
    from moepar.config import config_reference
    out = []
    for line in config_reference().splitlines():
        text = line.strip()
        if text.startswith("[") and text.endswith("]"):
            out += ["", f"### `{text}`", "", "| key | default | meaning |", "|---|---|---|"]
            continue
        assignment, _, comment = text.partition(" # ")
        key, _, default = assignment.partition(" = ")
        cell = comment.strip().replace("|", "\\|")
        out.append(f"| `{key.strip()}` | `{default.strip()}` | {cell} |")
    return "\n".join(out).strip("\n")


def plan_rules_markdown() -> str:
    from moepar.plan.rules import RULES
    return "```\n" + RULES.rstrip("\n") + "\n```"


BLOCKS = {"config-reference": ("docs/configuration.md", config_reference_markdown),
          "plan-rules": ("docs/planner.md", plan_rules_markdown)}


def render(text: str, name: str, body: str) -> str:
    """`text` with the block `name` holding `body`; raises when the page lacks its markers."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- /generated: {name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs_reference: no '<!-- generated: {name} -->' ... "
                         f"'<!-- /generated: {name} -->' markers in the page")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text, count=1)


def stale_pages(write: bool) -> list[str]:
    """The pages whose generated blocks differ from their sources (rewritten when `write`)."""
    stale = []
    for name, (page, make) in BLOCKS.items():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        new = render(text, name, make())
        if new != text:
            stale.append(f"{page} ({name})")
            if write:
                path.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = stale_pages(write=not check)
    if check and stale:
        print("docs_reference: out of date: " + ", ".join(stale) +
              "; run python scripts/docs_reference.py", file=sys.stderr)
        return 1
    for page in stale:
        print(f"docs_reference: rewrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
