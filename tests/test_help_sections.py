"""``kvgate serve --help`` reads as sections: one argument group per config Group, every key's flag in its own
group's section, a one-line usage, and the flags parse as before."""

from __future__ import annotations

import argparse

import pytest

from kvgate.cli import _FlagsHelp, build_parser
from kvgate.config import GROUPS, KEYS, flag_name


def _serve() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def _sections(text: str) -> dict[str, list[str]]:
    """The help's sections: a title line (no indent, ends in ':') and the lines under it."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def test_every_key_is_in_one_of_the_nine_groups_and_each_group_has_keys():
    titles = [g.title for g in GROUPS]
    assert titles == ["upstream and engines", "server", "server limits", "session lifecycle", "session naming",
                      "placement and PD", "admission (ledger)", "admission (program policy)", "shared state (Redis)"]
    assert {k.group for k in KEYS} == set(titles)
    counts = {t: sum(k.group == t for k in KEYS) for t in titles}
    assert min(counts.values()) >= 4 and sum(counts.values()) == len(KEYS)
    # every key documented "program policy: ..." is in the program group, every "fifo policy: ..." in the ledger's
    assert all(k.group == "admission (program policy)" for k in KEYS if k.doc.startswith("program policy:"))
    assert all(k.group == "admission (ledger)" for k in KEYS if k.doc.startswith("fifo policy:"))


@pytest.mark.parametrize("width", [78, 98, 158])
def test_help_lists_each_flag_under_its_section_in_group_order(width):
    serve = _serve()
    serve.formatter_class = lambda prog: _FlagsHelp(prog, width=width)
    text = serve.format_help()
    sections = _sections(text)
    assert list(sections) == ["positional arguments", "options", *[g.title for g in GROUPS]]
    for g in GROUPS:
        body = "\n".join(sections[g.title])
        assert body.splitlines()[0].strip() == g.description  # under the title, one line, then the flags
        for k in KEYS:
            shown = ("--[no-]" + flag_name(k.name)[2:]) if k.type is bool else flag_name(k.name) + " "
            assert (shown in body) == (k.group == g.title), (k.name, g.title)
    usage = text.split("\n\n")[0]
    assert usage == "usage: kvgate serve [-h] [--config FILE] [--FLAG VALUE ...] [config_file]"


def test_help_is_a_line_shorter_per_flag_on_a_wide_terminal():
    serve = _serve()
    lines = {}
    for width, pos in ((98, 34), (158, 34), (97, 24)):
        serve.formatter_class = lambda prog, w=width: _FlagsHelp(prog, width=w)
        text = serve.format_help()
        lines[width] = len(text.splitlines())
        port = next(line for line in text.splitlines() if line.startswith("  --port PORT"))
        assert port.index("Port kvgate listens on") == pos
    # at 100 columns the help starts in column 34: the flag's own line holds its help's first line
    assert lines[98] <= lines[97] - 30
    assert lines[98] < 360 and lines[158] < 260


def test_flags_parse_as_before_grouped():
    p = build_parser()
    ns = p.parse_args(["serve", "--port", "8080", "--no-compat-probe", "--agentic-session-lifecycle",
                       "--redis-url", "redis://h:1/0", "--admission-pause-victim", "ahead", "--engines", "http://a:1",
                       "http://b:2"])
    assert (ns.port, ns.compat_probe, ns.agentic_session_lifecycle, ns.redis_url, ns.admission_pause_victim,
            ns.engines) == ("8080", False, True, "redis://h:1/0", "ahead", ["http://a:1", "http://b:2"])
    assert p.parse_args(["check-config", "--compat-probe"]).compat_probe is True
    assert p.parse_args(["serve"]).compat_probe is None  # unset: the YAML file's value (or the default) stands



def test_the_example_config_has_the_help_sections_in_order_each_key_under_its_own():
    """configs/kvgate.yaml reads as ``--help`` does: a ``# --- title: description ---`` line per Group, in GROUPS
    order, and under each the keys of that group in KEYS order."""
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "configs" / "kvgate.yaml").read_text()
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# --- "):
            assert line == f"# --- {GROUPS[len(sections)].title}: {GROUPS[len(sections)].description} ---"
            sections.append((GROUPS[len(sections)].title, []))
        elif line and not line.startswith(("#", " ")):
            sections[-1][1].append(line.split(":")[0])
    assert [t for t, _ in sections] == [g.title for g in GROUPS]
    for title, keys in sections:
        assert keys == [k.name for k in KEYS if k.group == title], title
