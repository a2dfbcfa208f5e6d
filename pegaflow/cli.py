"""The command line of pegaflow's programs: a mistake is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (--help lists every flag)", file=sys.stderr)
        sys.exit(2)
