"""The command line of pegaflow's programs: a mistake is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

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
        print(f"{self.prog}: {message} (--help lists every flag)", file=sys.stderr)
        sys.exit(2)
