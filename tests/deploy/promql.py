"""The series a PromQL expression selects: each metric name and its label matchers.

Enough of PromQL for checking deploy/'s dashboard and rules against what the exporter emits:
strings, durations, ``offset``, grouping clauses (``by (...)``, ``on (...)``...), functions
and aggregations are told apart from the metric names between them.  Grafana's variables
(``$__rate_interval``, ``$engine``) are taken as a duration and as plain text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r'''
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<matchers>\{[^{}]*\})
  | (?P<range>\[[^\]]*\])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<number>[0-9][0-9.eE+-]*[a-z]*)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<space>\s+)
  | (?P<other>[-+*/%^=!<>,~]+)
''', re.VERBOSE)
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")\s*,?')
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"offset", "bool", "and", "or", "unless", "inf", "nan", "Inf", "NaN"}


class PromQLSyntaxError(ValueError):
    """An expression this reader cannot take apart."""


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


@dataclass(frozen=True, slots=True)
class Parsed:
    selectors: tuple[Selector, ...]
    grouping_labels: frozenset[str]  # the labels named by by/without/on/ignoring/group_*


def _tokens(expr: str) -> list[tuple[str, str]]:
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    tokens, at = [], 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise PromQLSyntaxError(f"cannot read {expr[at:at + 20]!r} in {expr!r}")
        if match.lastgroup != "space":
            tokens.append((match.lastgroup, match.group()))
        at = match.end()
    return tokens


def _matchers(block: str) -> tuple[tuple[str, str, str], ...]:
    inner, found, at = block[1:-1], [], 0
    while at < len(inner.rstrip()):
        match = _MATCHER.match(inner, at)
        if match is None:
            raise PromQLSyntaxError(f"cannot read the label matchers {block!r}")
        found.append((match.group(1), match.group(2), match.group(3)[1:-1]))
        at = match.end()
    return tuple(found)


def parse(expr: str) -> Parsed:
    """The selectors of ``expr`` and the labels its grouping clauses name."""
    tokens = _tokens(expr)
    selectors, grouping, i = [], set(), 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1] if i + 1 < len(tokens) else ("end", "")
        if kind == "ident" and text in GROUPING and after[0] == "open":
            close = next(j for j in range(i + 2, len(tokens)) if tokens[j][0] == "close")
            grouping |= {t for k, t in tokens[i + 2:close] if k == "ident"}
            i = close + 1
            continue
        if kind == "ident" and text == "offset":
            i += 2  # its duration
            continue
        is_call = after[0] == "open" or (after[0] == "ident" and after[1] in ("by", "without"))
        if kind == "ident" and text not in KEYWORDS and not is_call:
            matchers = _matchers(after[1]) if after[0] == "matchers" else ()
            selectors.append(Selector(text, matchers))
        elif kind == "matchers" and (i == 0 or tokens[i - 1][0] != "ident"):
            raise PromQLSyntaxError(f"a selector without a metric name in {expr!r}")
        i += 1
    return Parsed(tuple(selectors), frozenset(grouping))
