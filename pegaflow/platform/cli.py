"""The command line of pegaflow's programs: every message on stderr is one line that starts with
the program's name (``pegaflow-engine: ...``), and the exit codes mean the same in each
(docs/operations.md, "Exit codes")."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1          # could not do what was asked: no engine, a failed start, a failed check
EXIT_USAGE = 2           # a mistake in a flag or a PEGAFLOW_* variable: nothing was done
EXIT_NOT_RESPONDING = 3  # pegaflow-stat: the engine's process is there, its heartbeat stopped

# What reads as a negative value, not a flag: -5, -0.5, and sizes such as -5GiB (so that
# `--pool-size -5GiB` is refused as negative, not as a missing value).  None of our flags
# looks like it.
_NEGATIVE_VALUE = re.compile(r"^-\d*\.?\d+[A-Za-z]*$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line (argparse prints the whole usage first), and a
    negative size is a value."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE  # argparse's own knows no units

    def error(self, message: str) -> NoReturn:
        say(self.prog, f"{message} (--help lists every flag)")
        sys.exit(EXIT_USAGE)


def say(prog: str, message: str) -> None:
    """One line on stderr, ``prog: message``: how every pegaflow program speaks of a problem."""
    print(f"{prog}: {message}", file=sys.stderr)
