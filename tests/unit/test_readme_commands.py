"""Every `moepar ...` command in the code blocks of README.md and of every docs/*.md page parses
with the real parser of its subcommand, and `moepar train`'s (and `plan`'s, `eval`'s) config
overrides with load_config: an unknown flag or config key fails here. Nothing runs. The pages
are read at test time.

Which lines are commands: in a block with `$ ` prompts, the prompt lines only (the rest is
output); elsewhere every line (and each `&&`/`;` part) that starts with `moepar COMMAND` or
runs `-m moepar COMMAND`. Usage synopses are expanded: `[...]` groups are kept, `A | B` inside
one gives a variant per alternative, a trailing `(see ...)` is dropped. Placeholders (`N`,
`FILE`, `R,..`, `$VAR`, `<...>`, `HOST:PORT`) become a value of the option's type.
"""

import argparse
import contextlib
import io
import itertools
import pathlib
import re
import shlex

import pytest

from moepar.cli import COMMANDS
from moepar.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.toml")
PLACEHOLDER = re.compile(r"^(\$\{?\w+\}?|<[^>]*>|[A-Z][A-Z0-9_]*(,\.\.)?|HOST:PORT)$")


def code_blocks(text: str) -> list[list[str]]:
    """The fenced blocks' lines, with backslash continuations joined."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    out = []
    for block in blocks:
        lines, current = [], ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                current += (line.strip() if current else line.rstrip())[:-1].rstrip() + " "
                continue
            lines.append(current + line.strip() if current else line)
            current = ""
        out.append(lines + ([current] if current else []))
    return out


def _moepar_part(part: str) -> str | None:
    """'moepar COMMAND ...' in a shell fragment, or None."""
    part = part.strip()
    m = re.search(r"(?:^|\s)-m moepar (.*)$", part)
    if m:
        part = "moepar " + m.group(1)
    words = part.split()
    if len(words) < 2 or words[0] != "moepar":
        return None
    if words[1] not in COMMANDS and words[1] not in ("--version", "--help", "-h"):
        return None          # prose ("moepar plan chooses"), output ("moepar plan: ...")
    return part


def shell_parts(line: str) -> list[str]:
    """A shell line split at &&, ||, ;, | and { } outside [...] (a synopsis's `[A | B]`)."""
    parts, current, depth, i = [], "", 0, 0
    while i < len(line):
        ch = line[i]
        depth += (ch == "[") - (ch == "]")
        two = line[i:i + 2]
        if depth == 0 and two in ("&&", "||"):
            parts.append(current)
            current, i = "", i + 2
            continue
        if depth == 0 and ch in ";|{}":
            parts.append(current)
            current = ""
        else:
            current += ch
        i += 1
    return parts + [current]


def _refusal(lines: list[str], i: int) -> bool:
    """The output shown after the prompt at lines[i] is an error (a documented refusal)."""
    for line in lines[i + 1:]:
        if line.strip().startswith("$ "):
            return False
        if "error" in line.lower():
            return True
    return False


def readme_commands(text: str) -> list[str]:
    """The commands to parse; documented refusals (a `$ ` command whose output shows an error,
    e.g. a bad config value) are left out."""
    found = []
    for lines in code_blocks(text):
        prompted = [line.strip()[2:] for i, line in enumerate(lines)
                    if line.strip().startswith("$ ") and not _refusal(lines, i)]
        if not prompted and any(line.strip().startswith("$ ") for line in lines):
            continue
        for line in prompted or lines:
            line = re.split(r"\s#\s|^#", line)[0]                  # a trailing comment
            for part in shell_parts(line):
                command = _moepar_part(part)
                if command and command not in found:
                    found.append(command)
    return found


def variants(command: str) -> list[str]:
    """A usage synopsis as concrete commands: brackets opened, alternatives spread."""
    command = re.sub(r"\s+\([^()]*\)\s*$", "", command)       # (see Pipeline parallelism)
    groups = re.findall(r"\[([^\[\]]*)\]", command)
    skeleton = re.sub(r"\[[^\[\]]*\]", "\0", command)
    choices = [[alt.strip() for alt in g.split(" | ")] for g in groups]
    out = []
    for pick in itertools.product(*choices):
        text = skeleton
        for alt in pick:
            text = text.replace("\0", alt, 1)
        out.append(" ".join(text.split()))
    return out


def _actions(parser: argparse.ArgumentParser) -> dict:
    return {s: a for a in parser._actions for s in a.option_strings}


def _value(action, option: str) -> str:
    """A plausible value for a placeholder of `option` (None: a positional)."""
    if option in ("--rdzv-endpoint",):
        return "node0:29500"
    if option in (None, "--config"):
        return TINY
    if action is None:
        return "0"
    if action.choices:
        return str(list(action.choices)[0])
    return {int: "2", float: "0.5"}.get(action.type, "0")


def substitute(argv: list[str], parser) -> list[str]:
    """Placeholders replaced by values the parser (and the config) accept."""
    actions = _actions(parser)
    out = []
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if eq and option.startswith("--") and PLACEHOLDER.match(value):
            out.append(f"{option}={_value(actions.get(option), option)}")
        elif PLACEHOLDER.match(arg) and not arg.startswith("-"):
            prev = argv[i - 1] if i and argv[i - 1].startswith("--") else None
            out.append(_value(actions.get(prev), prev) if prev else _value(None, None))
        else:
            out.append(arg)
    return out


def _config(path: str) -> str:
    """The config file a command names, if it exists now. A file an earlier README step writes
    (runs/converted/config.toml from a Hugging Face model, plan.toml) is stood in for by a
    model of that size (Mixtral's: long sequences allowed), so its overrides still count."""
    if (ROOT / path).is_file():
        return str(ROOT / path)
    if "/" not in path and _packaged(path):     # `moepar train tiny`
        return path
    return str(ROOT / "examples" / "mixtral_8x7b.toml")


def _packaged(name: str) -> bool:
    from moepar.config import packaged_examples
    return name.removesuffix(".toml") in packaged_examples()


def _parse(parser, argv, known=False):
    """parser.parse_args / parse_known_args; an argparse error becomes an AssertionError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_known_args(argv) if known else parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"argparse refused {shlex.join(argv)}: "
                             f"{err.getvalue().strip()}") from None


# Paths that an earlier README step creates (data/mine, runs/converted): the config checks they
# exist, so an existing file or folder of the same kind stands in for them.
STAND_INS = {"data.path": str(ROOT / "README.md"), "run.init_from": str(ROOT / "examples"),
             "run.resume_from": str(ROOT / "examples")}


def _stand_ins(overrides: list[str]) -> list[str]:
    out = list(overrides)
    for i, arg in enumerate(out):
        key, eq, value = arg[2:].partition("=")
        if key in STAND_INS:
            at = i if eq else i + 1
            if at < len(out) and not (ROOT / (value if eq else out[at])).exists():
                out[at] = f"--{key}={STAND_INS[key]}" if eq else STAND_INS[key]
    return out


def _overrides(config: str, rest: list[str]):
    """Unknown flags fail (load_config takes only --section.key=value), and so do unknown keys."""
    try:
        load_config(_config(config), _stand_ins(rest))
    except ValueError as e:
        raise AssertionError(f"config {config!r} with {rest}: {e}") from None


def check_train(argv: list[str]):
    from moepar.cluster import launcher_argv, pop_multinode
    from moepar.launch import build_parser
    parser = build_parser()
    flags, _, rest = pop_multinode(substitute(argv, parser))
    args, overrides = _parse(parser, rest, known=True)
    launcher_argv(args.nproc, flags)        # the multi-node flags, as moepar train checks them
    _overrides(args.config, overrides)


def check_plan(argv: list[str]):
    from moepar.plan.cli import build_parser
    from moepar.plan.hardware import resolve_gpu
    parser = build_parser()
    args, rest = _parse(parser, substitute(argv, parser), known=True)
    # as moepar plan's main: dotted options are config overrides, anything else is refused
    dotted = [a for a in rest if a.startswith("--") and "." in a.split("=", 1)[0]]
    unknown = [a for a in rest if a not in dotted]
    assert not unknown, f"moepar plan: unrecognized arguments: {unknown}"
    resolve_gpu(args.gpu, dict(item.split("=", 1) for item in args.set))
    # MODEL may be a Hugging Face folder; the overrides are checked against a moepar config
    _overrides(args.model if args.model.endswith(".toml") else TINY, dotted)


def check_eval(argv: list[str]):
    from moepar.infer.evaluate import build_parser
    parser = build_parser()
    args, rest = _parse(parser, substitute(argv, parser), known=True)
    _overrides(args.source, rest)     # a run or checkpoint: _config stands in for its config


def check_convert(argv: list[str]):
    from moepar.hf.cli import _positionals_last, build_parser
    parser = build_parser()
    _parse(parser, _positionals_last(substitute(argv, parser)))


def check_plain(module: str):
    def check(argv: list[str]):
        import importlib
        parser = importlib.import_module(module).build_parser()
        sub = _subparser(parser, argv)
        args = _parse(parser, substitute(argv, sub or parser))
        if getattr(args, "config", None):     # moepar bench ... --config FILE
            _overrides(args.config, [])
    return check


def check_bench(argv: list[str]):
    """As moepar bench's main: `traffic` and `train` take config overrides after their options;
    the other benchmarks refuse anything their parser does not know."""
    from moepar.bench import build_parser
    parser = build_parser()
    sub = _subparser(parser, argv)
    args, rest = _parse(parser, substitute(argv, sub or parser), known=True)
    if args.what in ("traffic", "train"):
        _overrides(args.config, rest)
        return
    assert not rest, f"moepar bench: unrecognized arguments: {rest}"
    if getattr(args, "config", None):     # moepar bench ... --config FILE
        _overrides(args.config, [])


def _subparser(parser, argv):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            return action.choices[argv[0]]
    return None


CHECKS = {"train": check_train, "plan": check_plan, "eval": check_eval, "convert": check_convert,
          "bench": check_bench, "data": check_plain("moepar.data.cli"),
          "inspect": check_plain("moepar.inspect"),
          "generate": check_plain("moepar.infer.generate")}


def check(command: str, page: str = "README.md"):
    """Raises AssertionError (naming the page, the command and the problem) unless every variant
    of `command` parses."""
    for variant in variants(command):
        words = shlex.split(variant)[1:]
        if words[0] in ("--version", "--help", "-h"):
            continue
        assert words[0] in CHECKS, f"no parser check for `moepar {words[0]}`: add one to CHECKS"
        try:
            CHECKS[words[0]](words[1:])
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"{page}: `{variant}`: {e}") from None


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of README.md and docs/*.md, each page's once."""
    out = []
    for path in PAGES:
        name = str(path.relative_to(ROOT))
        out += [(name, c) for c in readme_commands(path.read_text(encoding="utf-8"))]
    return out


COMMANDS_IN_PAGES = page_commands()
COMMANDS_IN_README = [c for page, c in COMMANDS_IN_PAGES if page == "README.md"]


def test_readme_has_commands_of_every_kind_it_documents():
    kinds = {shlex.split(c)[1] for c in COMMANDS_IN_README}
    assert "train" in kinds, kinds          # the first of the two commands
    assert all(k in CHECKS for k in kinds - {"--version", "--help", "-h"}), kinds


def test_the_docs_show_every_command():
    """docs/ is read (it holds most of the commands), and every `moepar X` is shown at work."""
    in_docs = [c for page, c in COMMANDS_IN_PAGES if page.startswith("docs/")]
    assert len(in_docs) > len(COMMANDS_IN_README), (len(in_docs), len(COMMANDS_IN_README))
    assert {shlex.split(c)[1] for c in in_docs} >= set(CHECKS), sorted(CHECKS)


@pytest.mark.parametrize("page, command", COMMANDS_IN_PAGES,
                         ids=[f"{p}:{c[:60]}" for p, c in COMMANDS_IN_PAGES])
def test_readme_command_parses(page, command):
    check(command, page)


# The checker itself: it must refuse what moepar would refuse.
BAD = ["moepar train examples/tiny.toml --nproc 2 --no-such-flag",
       "moepar train examples/tiny.toml --model.no_such_key=3",
       "moepar train examples/tiny.toml --train.steps=many",
       "moepar train examples/tiny.toml --nproc 2 --nnodes 2",               # no rendezvous
       "moepar train examples/tiny.toml --nproc 8 --nnodes 2:4 --rdzv-endpoint HOST:PORT "
       "--node-rank 1",                                                      # elastic + rank
       "moepar bench pipeline --virtual-local-rank 2",
       "moepar bench moe-layer [--tokens N --no-such 3]",
       "moepar bench memory --simulate --config examples/tiny.toml --model.dim=3",
       "moepar bench traffic tiny --model.no_such_key=3",
       "moepar bench traffic tiny --gpu z80",
       "moepar plan examples/tiny.toml --gpus 8 --set no_such_field=1",
       "moepar plan examples/tiny.toml --gpus 8 --router.nope=1",
       "moepar convert --from hf a --to nowhere b",
       "moepar inspect runs/tiny --no-such-flag"]


@pytest.mark.parametrize("command", BAD)
def test_the_checker_refuses_what_moepar_refuses(command):
    with pytest.raises(AssertionError, match="README.md: `moepar"):
        check(command)


def test_extraction_placeholders_and_synopses():
    text = "\n".join([
        "```", "$ moepar train tiny --nproc 3", "moepar: config error: ...", "$ moepar train tiny",
        "```",
        "```bash", "python3 -m venv .venv && moepar train examples/tiny.toml --train.steps=5",
        "torchrun --nproc_per_node 4 -m moepar train examples/tiny.toml   # workers",
        "moepar plan: output, not a command", "How moepar plan chooses",
        "moepar bench memory [--zero Z --dp N | --tp N] [--json]   (see ZeRO)",
        "moepar train examples/tiny.toml \\", "    --nproc 2",
        "moepar train tiny --run.resume=auto || { [ $? -eq 75 ] && moepar train tiny; }",
        "moepar inspect runs/tiny --json | python3 -m json.tool", "```"])
    commands = readme_commands(text)
    assert commands == ["moepar train tiny",
                        "moepar train examples/tiny.toml --train.steps=5",
                        "moepar train examples/tiny.toml",
                        "moepar bench memory [--zero Z --dp N | --tp N] [--json]   (see ZeRO)",
                        "moepar train examples/tiny.toml --nproc 2",
                        "moepar train tiny --run.resume=auto",
                        "moepar inspect runs/tiny --json"]
    assert variants(commands[3]) == ["moepar bench memory --zero Z --dp N --json",
                                     "moepar bench memory --tp N --json"]
    from moepar.bench import build_parser
    sub = _subparser(build_parser(), ["memory"])
    assert substitute(["memory", "--zero", "Z", "--dp", "N", "--ranks=R,.."], sub) == \
        ["memory", "--zero", "0", "--dp", "2", "--ranks=0"]
    for command in commands:
        check(command)
