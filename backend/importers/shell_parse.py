"""A bash script's tokens (shell_words.py) as a tree of commands, for `shell_script.py` to read as data.

Grammar covered: lists joined by newlines, `;` and `&`; `&&` / `||`; pipelines (`!` negates); simple commands with
assignments, array assignments (`A=(...)`, `A+=(...)`) and redirections (their targets dropped); `[[ ... ]]`; the
compound commands `if / elif / else / fi`, `case ... esac`, `while` / `until`, `for`, `{ ...; }`, `( ... )` and
function definitions. Nesting is bounded (MAX_DEPTH), so a hostile script cannot exhaust the interpreter's stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.importers.import_result import ConfigImportError
from backend.importers.shell_words import REDIRECTS, ArrayStart, Op, Token, Word

MAX_DEPTH = 64
"""Compound commands nested in one another (a launch script nests two or three)."""


@dataclass
class ArrayAssign:
    name: str
    append: bool
    elements: list[Word]
    line: int


@dataclass
class Simple:
    items: list[Word | ArrayAssign]
    line: int


@dataclass
class DoubleBracket:
    """`[[ ... ]]`: its tokens, operators included."""
    tokens: list[Word | Op]
    line: int


@dataclass
class If:
    branches: list[tuple[list, list]]
    """(condition, body) of the `if` and each `elif`."""
    orelse: list | None
    line: int


@dataclass
class Case:
    word: Word
    items: list[tuple[list[Word], list]]
    line: int


@dataclass
class Loop:
    kind: str
    """while, until or for."""
    condition: list
    body: list
    line: int


@dataclass
class Function:
    name: str
    body: object
    line: int


@dataclass
class Group:
    body: list
    subshell: bool
    line: int


@dataclass
class Pipeline:
    commands: list
    negate: bool = False


@dataclass
class AndOr:
    first: Pipeline
    rest: list[tuple[str, Pipeline]] = field(default_factory=list)


class _Parser:
    def __init__(self, tokens: list[Token]):
        self.t, self.i, self.depth = tokens, 0, 0

    def peek(self, ahead: int = 0) -> Token | None:
        return self.t[self.i + ahead] if self.i + ahead < len(self.t) else None

    def keyword(self, ahead: int = 0) -> str | None:
        tok = self.peek(ahead)
        return tok.literal if isinstance(tok, Word) else None

    def is_op(self, *texts: str) -> bool:
        tok = self.peek()
        return isinstance(tok, Op) and tok.text in texts

    def line(self) -> int:
        tok = self.peek() or (self.t[-1] if self.t else None)
        return tok.line if tok is not None else 1

    def fail(self, what: str) -> ConfigImportError:
        return ConfigImportError([f"line {self.line()}: {what}: not a shell script ShardLab can read"])

    def expect(self, word: str) -> None:
        if self.keyword() != word:
            raise self.fail(f"expected '{word}'")
        self.i += 1

    def skip(self, *ops: str) -> None:
        while self.is_op(*ops):
            self.i += 1

    def body(self, stops: tuple[str, ...]) -> list:
        nodes = []
        while True:
            self.skip("\n", ";", "&")
            tok = self.peek()
            if tok is None:
                if stops:
                    raise self.fail(f"the script ends before '{stops[-1]}'")
                return nodes
            if self.keyword() in stops or (isinstance(tok, Op) and tok.text in stops):
                return nodes
            nodes.append(self.and_or())

    def and_or(self) -> AndOr:
        node = AndOr(self.pipeline())
        while self.is_op("&&", "||"):
            op = self.peek().text
            self.i += 1
            self.skip("\n")
            node.rest.append((op, self.pipeline()))
        return node

    def pipeline(self) -> Pipeline:
        negate = self.keyword() == "!"
        self.i += negate
        commands = [self.command()]
        while self.is_op("|"):
            self.i += 1
            self.skip("\n")
            commands.append(self.command())
        return Pipeline(commands, negate)

    def command(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"commands nested more than {MAX_DEPTH} deep")
        line, word = self.line(), self.keyword()
        if word == "if":
            node = self.if_()
        elif word == "case":
            node = self.case()
        elif word in ("while", "until", "for"):
            node = self.loop(word)
        elif word == "{":
            self.i += 1
            node = Group(self.body(("}",)), False, line)
            self.expect("}")
        elif self.is_op("("):
            self.i += 1
            node = Group(self.body((")",)), True, line)
            if not self.is_op(")"):
                raise self.fail("expected ')'")
            self.i += 1
        elif word == "function" or (word and isinstance(self.peek(1), Op) and self.peek(1).text == "("
                                    and isinstance(self.peek(2), Op) and self.peek(2).text == ")"):
            node = self.function()
        elif word == "[[":
            node = self.double_bracket()
        else:
            node = self.simple()
        self.redirections()
        self.depth -= 1
        return node

    def redirections(self) -> None:
        while self.is_op(*REDIRECTS):
            self.i += 1
            if isinstance(self.peek(), Word):
                self.i += 1

    def simple(self) -> Simple:
        items: list[Word | ArrayAssign] = []
        line = self.line()
        while True:
            tok = self.peek()
            if isinstance(tok, Word):
                items.append(tok)
                self.i += 1
            elif isinstance(tok, ArrayStart):
                self.i += 1
                items.append(ArrayAssign(tok.name, tok.append, self.array_elements(), tok.line))
            elif isinstance(tok, Op) and tok.text in REDIRECTS:
                self.redirections()
            else:
                break
        if not items and not isinstance(self.peek(), Op):
            raise self.fail("expected a command")
        if not items:
            raise self.fail(f"unexpected '{self.peek().text.strip() or 'newline'}'")
        return Simple(items, line)

    def array_elements(self) -> list[Word]:
        elements = []
        while True:
            self.skip("\n")
            tok = self.peek()
            if isinstance(tok, Word):
                elements.append(tok)
                self.i += 1
            elif isinstance(tok, Op) and tok.text == ")":
                self.i += 1
                return elements
            else:
                raise self.fail("an array assignment (NAME=( ... )) is never closed")

    def double_bracket(self) -> DoubleBracket:
        line = self.line()
        self.i += 1
        tokens = []
        while self.keyword() != "]]":
            tok = self.peek()
            if tok is None or isinstance(tok, ArrayStart) or (isinstance(tok, Op) and tok.text == "\n"):
                raise self.fail("'[[' without its ']]'")
            tokens.append(tok)
            self.i += 1
        self.i += 1
        return DoubleBracket(tokens, line)

    def if_(self) -> If:
        node = If([], None, self.line())
        self.i += 1
        while True:
            condition = self.body(("then",))
            self.expect("then")
            node.branches.append((condition, self.body(("elif", "else", "fi"))))
            if self.keyword() != "elif":
                break
            self.i += 1
        if self.keyword() == "else":
            self.i += 1
            node.orelse = self.body(("fi",))
        self.expect("fi")
        return node

    def case(self) -> Case:
        line = self.line()
        self.i += 1
        word = self.peek()
        if not isinstance(word, Word):
            raise self.fail("expected the word 'case' tests")
        self.i += 1
        self.skip("\n")
        self.expect("in")
        items = []
        while True:
            self.skip("\n", ";")
            if self.keyword() == "esac":
                self.i += 1
                return Case(word, items, line)
            self.skip("(")
            patterns = [self.pattern()]
            while self.is_op("|"):
                self.i += 1
                patterns.append(self.pattern())
            if not self.is_op(")"):
                raise self.fail("expected ')' after a case pattern")
            self.i += 1
            items.append((patterns, self.body(("esac", ";;"))))
            self.skip(";;")

    def pattern(self) -> Word:
        tok = self.peek()
        if not isinstance(tok, Word):
            raise self.fail("expected a case pattern")
        self.i += 1
        return tok

    def loop(self, kind: str) -> Loop:
        line = self.line()
        self.i += 1
        if kind == "for":
            while self.keyword() != "do":
                if self.peek() is None:
                    raise self.fail("'for' without 'do'")
                self.i += 1
            condition = []
        else:
            condition = self.body(("do",))
        self.expect("do")
        body = self.body(("done",))
        self.expect("done")
        return Loop(kind, condition, body, line)

    def function(self) -> Function:
        line = self.line()
        if self.keyword() == "function":
            self.i += 1
        name = self.keyword() or "?"
        self.i += 1
        if self.is_op("("):
            self.i += 2
        self.skip("\n")
        return Function(name, self.command(), line)


def parse(tokens: list[Token]) -> list:
    """The script's top-level commands; ConfigImportError (with the line) for what this grammar does not read."""
    return _Parser(tokens).body(())
