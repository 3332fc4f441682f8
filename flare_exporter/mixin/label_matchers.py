"""The --selector flag of `flare rules` and the dashboards: label matchers as Prometheus takes them between
{ and }, so that a selector it would reject stops the command instead of yielding rules or dashboards that
no Prometheus loads.
"""

from __future__ import annotations

import re
import warnings

from ..config import ConfigError

_BLANK = "[ \t\r\n]*"  # what PromQL's lexer skips between tokens
# One matcher and the comma after it: a label name (an identifier; not the UTF-8 "quoted" names only
# Prometheus 3 reads), an operator, a string literal ("...", '...' with escapes, `...` raw).
MATCHER = re.compile(
    rf"{_BLANK}(?P<name>[A-Za-z_][A-Za-z0-9_]*){_BLANK}(?P<op>=~|!~|!=|=){_BLANK}"
    r"(?P<value>\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)"
    rf"{_BLANK}(?P<comma>,?){_BLANK}"
)
BARE_VALUE = re.compile(rf"{_BLANK}[A-Za-z_][A-Za-z0-9_]*{_BLANK}(?:=~|!~|!=|=){_BLANK}[^\"'`\s,]")
# The escapes PromQL's lexer takes in a "..." or '...' string (the other quote is no escape).
ESCAPE = re.compile(
    r"\\(?:([abfnrtv\\\"'])|([0-7]{3})|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.?))", re.S
)
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
# Tokens of a regular expression, for what Go's RE2 (Prometheus's matchers) rejects and Python's re takes.
RE2_TOKEN = re.compile(
    r"(?P<perl>\(\?(?:<=|<!|=|!|P=|P>))"  # lookaround, backreference, recursion
    r"|(?P<backref>\\[1-9](?![0-7]))"
    r"|(?P<flags>\(\?[A-Za-z-]*\))"
    r"|(?P<open>\((?:\?(?:P?<[A-Za-z_][A-Za-z0-9_]*>|[A-Za-z-]*:))?)"
    r"|(?P<repeat>\{(?P<least>\d+)(?:,(?P<most>\d*))?\})"
    r"|(?P<quantifier>[*+?])"
    r"|(?P<bar>\|)"
    r"|\\Q.*?(?:\\E|$)|\\.|\[\^?\]?(?:\[:\^?[a-z]+:\]|\\.|[^\]\\])*\]|.",
    re.S,
)
RE2_MAX_REPEAT = 1000
# Python's errors for a regular expression that RE2 rejects too (others, e.g. an escape Python does not
# know such as \pL, may be RE2's syntax).
_REGEX_ERRORS_OF_BOTH = (
    "missing ), unterminated subpattern",
    "unbalanced parenthesis",
    "unterminated character set",
    "bad character range",
    "min repeat greater than max repeat",
)


def check_selector(text: str) -> str:
    """The label matchers of --selector (braces optional), one ", " between them; ConfigError naming the
    flag for a selector that Prometheus would not parse: a matcher without a quoted value, an escape its
    lexer does not know, a regular expression RE2 does not compile, or __name__ (each rule names its
    metric)."""
    inner = text.strip(" \t\r\n")
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1]
    matchers, position = [], 0
    while position < len(inner):
        match = MATCHER.match(inner, position)
        if match is None:
            raise _selector_syntax_error(inner[position:])
        if not match["comma"] and match.end() < len(inner):
            raise _selector_error(f"expected a comma between label matchers at {inner[match.end() :]!r}")
        matchers.append(_matcher(match["name"], match["op"], match["value"]))
        position = match.end()
    return ", ".join(matchers)


def _selector_error(message: str) -> ConfigError:
    return ConfigError(f"flag --selector: {message}")


def _selector_syntax_error(rest: str) -> ConfigError:
    if BARE_VALUE.match(rest):
        return _selector_error(f'label values are quoted strings, e.g. cluster="eu-1": {rest!r}')
    return _selector_error(
        'expected label matchers such as cluster="eu-1", team=~"ml|infra" (a label name, one of '
        f"= != =~ !~, a quoted value), separated by commas, at {rest!r}"
    )


def _matcher(name: str, op: str, literal: str) -> str:
    if name == "__name__":
        raise _selector_error("__name__ matches the metric name, which every rule sets itself")
    if op in ("=~", "!~"):
        problem = regex_problem(_unquote(literal))
        if problem:
            raise _selector_error(
                f"{name}{op}{literal}: not a regular expression Prometheus takes: {problem}"
            )
    else:
        _unquote(literal)
    return f"{name}{op}{literal}"


def _unquote(literal: str) -> str:
    """The value of a PromQL string literal; ConfigError for an escape its lexer rejects."""
    quote, body = literal[0], literal[1:-1]
    if quote == "`":
        return body

    def escape(match: re.Match[str]) -> str:
        simple, octal, byte, short, long, _ = match.groups()
        if simple is not None and (simple in _SIMPLE_ESCAPES or simple == quote):
            return _SIMPLE_ESCAPES.get(simple, simple)
        digits = octal or byte or short or long
        if not digits:
            raise _selector_error(
                f"unknown escape sequence {match[0]} in {literal} (a backslash of a regular expression is "
                "written \\\\ in a quoted string, or quote the value with backticks)"
            )
        code = int(digits, 8 if octal else 16)
        if code > (255 if octal or byte else 0x10FFFF) or 0xD800 <= code <= 0xDFFF:
            raise _selector_error(f"escape sequence {match[0]} in {literal} is an invalid Unicode code point")
        return chr(code)

    return ESCAPE.sub(escape, body)


def regex_problem(pattern: str) -> str:
    """Why Prometheus would not compile `pattern`, or "": RE2's rules where Python's re is more lenient,
    then Python's errors that RE2 shares (on the pattern itself: Prometheus compiles it unanchored too, so
    that "a)|(b" fails though its anchored form parses)."""
    problem = _re2_only_problem(pattern)
    if problem:
        return problem
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "possible nested set": RE2's [[:alpha:]]
            re.compile(pattern)
    except re.error as error:
        if error.msg.startswith(_REGEX_ERRORS_OF_BOTH):
            return error.msg
    return ""


def _re2_only_problem(pattern: str) -> str:
    previous = "open"  # what the next repetition would repeat: open (nothing), atom, repeat, lazy
    for token in RE2_TOKEN.finditer(pattern):
        kind = token.lastgroup or "atom"
        if kind in ("perl", "backref"):
            return f"{token[0]} is Perl syntax that RE2 does not support"
        if kind in ("repeat", "quantifier"):
            problem = _repetition_problem(token, previous)
            if problem:
                return problem
            previous = "lazy" if previous == "repeat" else "repeat"
        elif kind != "flags":
            previous = "open" if kind in ("open", "bar") else "atom"
    return ""


def _repetition_problem(token: re.Match[str], previous: str) -> str:
    if previous == "open":
        return f"missing argument to repetition operator {token[0]}"
    if previous == "lazy" or (previous == "repeat" and token[0] != "?"):
        return f"invalid nested repetition operator {token[0]}"
    if token["repeat"] and max(int(token["least"]), int(token["most"] or 0)) > RE2_MAX_REPEAT:
        return f"invalid repeat count {token[0]} (at most {RE2_MAX_REPEAT})"
    return ""
