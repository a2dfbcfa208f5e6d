"""pegaflow/platform/cli.py: the one form of a problem's line, and the exit codes
docs/operations.md tabulates for every command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pegaflow.platform import cli

ROOT = Path(__file__).resolve().parents[3]


def _exit_code_table() -> list[list[str]]:
    """docs/operations.md's "Exit codes" table, a list of cells per row (the header first)."""
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows if "---" not in row]


def test_cli_exit_code_table_has_a_column_per_command_and_a_row_per_code():
    # 1. A column for each command an install makes (pyproject's console scripts).
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    commands = sorted(line.split("=")[0].strip() for line in scripts.splitlines() if "=" in line)
    header, *rows = _exit_code_table()
    assert sorted(header[2:]) == commands == ["pegaflow-engine", "pegaflow-proxy", "pegaflow-smoke",
                                             "pegaflow-stat"]
    # 2. A row for each code pegaflow's programs use, in order, and no other.
    codes = sorted(v for k, v in vars(cli).items() if k.startswith("EXIT_"))
    assert [int(row[0]) for row in rows] == codes == [0, 1, 2, 3]


def test_cli_say_is_one_line_prefixed_with_the_program(capsys):
    cli.say("pegaflow-x", "something is off")
    assert capsys.readouterr().err == "pegaflow-x: something is off\n"


def test_cli_parser_error_is_one_prefixed_line_and_exit_2(capsys):
    parser = cli.ArgumentParser(prog="pegaflow-x")
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["--nope"])
    assert stopped.value.code == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith("pegaflow-x: unrecognized arguments: --nope") and err.count("\n") == 1
