"""README.md and the server agree.

The README's options table lists the main options (`pyserve --help` lists
them all): every option it names must exist, and the default it gives must
be the one declared in pyserve/options.py. A default cell is either a
literal in backticks, compared with the declared default, or words ("none",
"the model's") for an option declared without a value (None or ""), which
the server resolves at start-up or leaves unset; "off" and "on" are a switch's False and True.
Where an option has a fixed set of values, the row names every one of them.

Beyond the table, every `--flag` the README shows for the `pyserve` command
(in prose or in a command line) must exist, every route in its routes table
must be served, and every repository path it links to must be there.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pyserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Flags of other programs that README's command lines show.
OTHER_PROGRAMS = ("uvicorn", "granian", "smg", "python bench/", "sudo ", "pip ", "cargo ")


def parser() -> argparse.ArgumentParser:
    """The parser `pyserve --help` prints."""
    return ServerArgs.parser()


def declared_options() -> dict[str, argparse.Action]:
    return {flag: action for action in parser()._actions for flag in action.option_strings}


def option_rows(text: str) -> list[list[str]]:
    """The rows of every `| option | default | meaning |` table, as cells."""
    rows, in_table = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            in_table = False
        elif cells[:3] == ["option", "default", "meaning"]:
            in_table = True
        elif in_table and not set(cells[0]) <= set("- :"):
            rows.append(cells)
    return rows


def _literal_matches(literal: str, default: object) -> bool:
    if isinstance(default, bool) or default is None:
        return False
    if isinstance(default, (int, float)):
        try:
            return float(literal) == float(default)
        except ValueError:
            return False
    return literal == str(default)


def check_row(cells: list[str], options: dict[str, argparse.Action]) -> list[str]:
    """What is wrong with one row of the options table ([] when nothing)."""
    flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
    if not flags:
        return [f"row {cells[0]!r} names no option"]
    missing = [f for f in flags if f not in options]
    if missing:
        return [f"{', '.join(missing)}: no such option"]
    actions = [options[f] for f in flags]
    dest = {a.dest for a in actions}
    if len(dest) != 1:
        return [f"{cells[0]}: one row, one option (these set {sorted(dest)})"]
    default = actions[0].default
    cell = cells[1]
    problems = []
    literal = re.match(r"`([^`]*)`", cell)
    if literal:
        if not _literal_matches(literal.group(1), default):
            problems.append(f"{flags[0]}: README's default {literal.group(1)!r}, declared {default!r}")
    elif cell in ("off", "on"):
        if default is not (cell == "on"):
            problems.append(f"{flags[0]}: README's default {cell!r}, declared {default!r}")
    elif default not in (None, ""):
        problems.append(f"{flags[0]}: README's default {cell!r} is words, but {default!r} is declared: "
                        "give it in backticks")
    for choice in actions[0].choices or ():
        if f"`{choice}`" not in cells[1] + cells[2]:
            problems.append(f"{flags[0]}: the row does not name the value `{choice}`")
    return problems


def pyserve_flags(text: str) -> set[str]:
    """Every `--flag` README shows for `pyserve`: in backticks in prose, and
    on `pyserve ...` command lines; other programs' command lines aside."""
    flags: set[str] = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            command = line.strip()
            if command.startswith("pyserve "):
                flags |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command.split("#")[0]))
        else:
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith(OTHER_PROGRAMS):
                    continue
                flags |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span))
    return flags


def test_the_readme_has_an_options_table_and_points_to_help():
    text = README.read_text()
    assert len(option_rows(text)) >= 20
    assert "`pyserve --help` lists every option" in text


@pytest.mark.parametrize("cells", option_rows(README.read_text()), ids=lambda cells: cells[0])
def test_each_row_of_the_options_table_is_declared_so(cells):
    assert check_row(cells, declared_options()) == []


def test_every_flag_the_readme_shows_exists():
    options = declared_options()
    assert sorted(f for f in pyserve_flags(README.read_text()) if f not in options) == []


def test_the_check_fails_on_a_wrong_readme():
    """The checks above can fail: an option that does not exist, a wrong
    default, a default in words for a declared value, a missing choice."""
    options = declared_options()
    table = "\n".join([
        "| option | default | meaning |",
        "| --- | --- | --- |",
        "| `--max-running-requests` | `65` | wrong default |",
        "| `--no-such-option` | off | does not exist |",
        "| `--port` | a free port | words for a declared default |",
        "| `--disable-radix-cache` | on | a switch that is off |",
        "| `--reasoning-parser` | none | `qwen3` only |",
        "| `--page-size` | `1` | right |",
    ])
    rows = option_rows(table)
    assert [bool(check_row(cells, options)) for cells in rows] == [True, True, True, True, True, False]
    assert pyserve_flags("```bash\npyserve --port 1 --no-such-flag\nuvicorn app:app --workers 2\n```\n"
                         "`--other-missing`") == {"--port", "--no-such-flag", "--other-missing"}


def readme_routes(text: str) -> list[tuple[str, str]]:
    section = text.split("\n## Routes\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(GET|POST|DELETE) (/[^`]*)`", section)


def test_every_route_in_the_readme_is_served():
    from pyserve.api.app import ROUTES

    def shape(path: str) -> str:  # `/v1/files/{file_id}` and `{model:path}` alike
        return re.sub(r"\{[^}]*\}", "{}", path)

    served = {(method, shape(path)) for method, path in ROUTES}
    routes = readme_routes(README.read_text())
    assert len(routes) >= 30
    assert [r for r in routes if (r[0], shape(r[1])) not in served] == []


def test_every_path_the_readme_links_to_exists():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert "../shared" not in text
