"""The tests (`[ ... ]`, `test`, `[[ ... ]]`) and the integer arithmetic (`$(( ... ))`) of a launch script, evaluated
as data for `shell_script.py`: string and integer comparisons on values the script sets are decided; a file test, a
regular expression, or a value the reader kept as written leaves the test undecided (Undecided). Three-valued logic:
`false && undecided` is false, `true || undecided` is true. Arithmetic is a small parser (+ - * / % ** and
parentheses on integers), never Python's eval.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Protocol

from backend.importers.shell_words import Op, Word

UNARY_STRING = {"-n": lambda s: s != "", "-z": lambda s: s == ""}
UNARY_UNKNOWABLE = frozenset("-e -f -d -s -r -w -x -L -h -p -S -b -c -g -u -k -O -G -N -t -a".split())
EQUAL = frozenset({"=", "=="})
INTEGER = {"-eq": lambda a, b: a == b, "-ne": lambda a, b: a != b, "-lt": lambda a, b: a < b,
           "-le": lambda a, b: a <= b, "-gt": lambda a, b: a > b, "-ge": lambda a, b: a >= b}
BINARY = EQUAL | {"!=", "<", ">", "=~", "-nt", "-ot", "-ef"} | set(INTEGER)
MAX_PARENS = 64


class Undecided(Exception):
    """The test depends on what a script read as data cannot know."""


class Expander(Protocol):
    def expand(self, word: Word, *, test: bool = False) -> Any: ...

    def lookup(self, name: str, index: str | None) -> Any: ...


class Test:
    """One test command's expression over its words (and, inside [[ ]], its operators)."""

    def __init__(self, reader: Expander, tokens: list, *, double: bool):
        self.reader, self.tokens, self.double, self.i, self.depth = reader, tokens, double, 0, 0
        self.logic = ("&&", "||") if double else ("-a", "-o")

    def evaluate(self) -> bool:
        if not self.tokens:
            return False
        result = self.or_()
        if self.i != len(self.tokens) or result is None:
            raise Undecided()
        return result

    def text(self, ahead: int = 0) -> str | None:
        """The operator spelled by the token `ahead` (a bare word or an operator token), else None."""
        if self.i + ahead >= len(self.tokens):
            return None
        tok = self.tokens[self.i + ahead]
        return tok.text if isinstance(tok, Op) else tok.literal

    def or_(self) -> bool | None:
        values = [self.and_()]
        while self.text() == self.logic[1]:
            self.i += 1
            values.append(self.and_())
        return True if True in values else (None if None in values else False)

    def and_(self) -> bool | None:
        values = [self.not_()]
        while self.text() == self.logic[0]:
            self.i += 1
            values.append(self.not_())
        return False if False in values else (None if None in values else True)

    def not_(self) -> bool | None:
        if self.text() == "!" and self.i + 1 < len(self.tokens):
            self.i += 1
            value = self.not_()
            return None if value is None else not value
        return self.primary()

    def primary(self) -> bool | None:
        op = self.text()
        if op == "(":
            self.depth += 1
            if self.depth > MAX_PARENS:
                raise Undecided()
            self.i += 1
            value = self.or_()
            if self.text() != ")":
                raise Undecided()
            self.i += 1
            self.depth -= 1
            return value
        unary = op in UNARY_STRING or op in UNARY_UNKNOWABLE or op == "-v"
        if unary and self.i + 1 < len(self.tokens) and self.text(2) not in BINARY:
            self.i += 1
            operand = self.operand()
            if op == "-v":
                return operand[0] is not None and self.reader.lookup(operand[0], None) is not None
            if op in UNARY_UNKNOWABLE or operand[0] is None:
                return None
            return UNARY_STRING[op](operand[0])
        left = self.operand()
        op = self.text()
        if op in BINARY:
            self.i += 1
            right = self.operand()
            return _binary(op, left[0], right[0], pattern=self.double and not right[1])
        return None if left[0] is None else left[0] != ""

    def operand(self) -> tuple[str | None, bool]:
        """(the operand's text, or None when it holds what the reader kept as written; quoted)."""
        if self.i >= len(self.tokens):
            raise Undecided()
        tok = self.tokens[self.i]
        self.i += 1
        if isinstance(tok, Op):
            return tok.text, False
        value = self.reader.expand(tok, test=True)
        return (value.text if value.known else None), any(p.quoted for p in tok.parts)


def _binary(op: str, left: str | None, right: str | None, *, pattern: bool) -> bool | None:
    if left is None or right is None or op in ("=~", "-nt", "-ot", "-ef"):
        return None
    if op in EQUAL or op == "!=":
        same = fnmatch.fnmatchcase(left, right) if pattern else left == right
        return same if op != "!=" else not same
    if op in ("<", ">"):
        return left < right if op == "<" else left > right
    try:
        return INTEGER[op](int(left), int(right))
    except ValueError:
        return None


ARITH_TOKEN = re.compile(r"\s*(?:(\d+)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$?([A-Za-z_][A-Za-z0-9_]*)|(\*\*|[-+*/%()]))")


def arithmetic(reader: Expander, text: str) -> int | None:
    """The value of an integer expression over the script's variables; None when it uses a value the reader does not
    know (an unset variable is unknown here, not 0), divides by zero, or is not this small grammar."""
    items: list[int | str] = []
    pos = 0
    while pos < len(text.rstrip()):
        m = ARITH_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            return None
        pos = m.end()
        number, braced, name, op = m.groups()
        if op:
            items.append(op)
            continue
        if number:
            items.append(int(number))
            continue
        value = reader.lookup(braced or name, None)
        if (value is None or not value.known or not isinstance(value.text, str)
                or not value.text.strip().lstrip("-").isdigit()):
            return None
        items.append(int(value.text))
    try:
        parser = _Arith(items)
        result = parser.sum()
        return result if parser.i == len(items) else None
    except (ValueError, ZeroDivisionError, IndexError, OverflowError):
        return None


class _Arith:
    def __init__(self, items: list[int | str]):
        self.items, self.i, self.depth = items, 0, 0

    def sum(self) -> int:
        value = self.product()
        while self.i < len(self.items) and self.items[self.i] in ("+", "-"):
            op = self.items[self.i]
            self.i += 1
            value = value + self.product() if op == "+" else value - self.product()
        return value

    def product(self) -> int:
        value = self.power()
        while self.i < len(self.items) and self.items[self.i] in ("*", "/", "%"):
            op = self.items[self.i]
            self.i += 1
            right = self.power()
            value = (value * right if op == "*" else int(value / right) if op == "/"
                     else value - right * int(value / right))
            if abs(value) > 1 << 63:
                raise OverflowError()
        return value

    def power(self) -> int:
        base = self.unary()
        if self.i < len(self.items) and self.items[self.i] == "**":
            self.i += 1
            exponent = self.power()
            if exponent < 0 or exponent > 64:
                raise ValueError()
            base **= exponent
        return base

    def unary(self) -> int:
        item = self.items[self.i]
        if item in ("-", "+"):
            self.i += 1
            return -self.unary() if item == "-" else self.unary()
        if item == "(":
            self.depth += 1
            if self.depth > MAX_PARENS:
                raise ValueError()
            self.i += 1
            value = self.sum()
            if self.items[self.i] != ")":
                raise ValueError()
            self.i += 1
            self.depth -= 1
            return value
        if isinstance(item, int):
            self.i += 1
            return item
        raise ValueError()
