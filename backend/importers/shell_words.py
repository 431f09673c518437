"""A bash script's text as tokens: words (with their quoted and expanded parts kept apart), operators, and the start of
an array assignment. The lexer of `shell_script.py`, which reads launch scripts as data: nothing here runs anything.

Covered: comments, backslash-newline continuations (also inside double quotes), single and double quotes, backslash
escapes, `$name`, `$1`, `$#`, `${...}` (nested), `$((...))`, `$(...)` and backquotes (kept as text: never run),
`NAME=(` / `NAME+=(` array starts, the operators `; ;; & && | || ( ) < > >> <<` (a heredoc's body is skipped), and a
file descriptor before a redirection (`2>&1`). Quoting is kept per part, so the reader can split unquoted expansions
into words as bash does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backend.importers.import_result import ConfigImportError

OPERATORS = (";;", "&&", "||", ">>", "<<", "&>", ">&", "<&", ">|", ";", "&", "|", "(", ")", "<", ">", "\n")
REDIRECTS = frozenset({">>", "<<", "&>", ">&", "<&", ">|", "<", ">"})
ASSIGN_START = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=$")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SPECIAL = "0123456789#@*?$!-"


@dataclass(frozen=True)
class Part:
    kind: str
    """lit (text as written), param (inside of ${...} or a name), cmd ($(...) or backquotes), arith ($((...)))."""
    text: str
    quoted: bool


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    line: int

    @property
    def literal(self) -> str | None:
        """The text of a word with no expansion and no quotes (a keyword, an operator word), else None."""
        if all(p.kind == "lit" and not p.quoted for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None


@dataclass(frozen=True)
class Op:
    text: str
    line: int


@dataclass(frozen=True)
class ArrayStart:
    name: str
    append: bool
    line: int


Token = Word | Op | ArrayStart


class _Lexer:
    def __init__(self, text: str):
        self.s, self.i, self.line = text, 0, 1
        self.tokens: list[Token] = []
        self.parts: list[Part] = []
        self.started = False
        self.heredocs: list[str] = []

    def run(self) -> list[Token]:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t":
                self.flush()
                self.i += 1
            elif c == "\\" and s.startswith("\n", self.i + 1):
                self.i += 2
                self.line += 1
            elif c == "#" and not self.started:
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif c in ";&|()<>\n":
                self.operator()
            elif c == "'":
                end = self.closing("'", self.i + 1)
                self.add(Part("lit", s[self.i + 1:end], True), s[self.i:end + 1])
                self.i = end + 1
            elif c == '"':
                self.double_quoted()
            elif c == "$":
                self.dollar(quoted=False)
            elif c == "`":
                end = self.closing("`", self.i + 1)
                self.add(Part("cmd", s[self.i + 1:end], False), s[self.i:end + 1])
                self.i = end + 1
            elif c == "\\":
                self.add(Part("lit", s[self.i + 1:self.i + 2], True), s[self.i:self.i + 2])
                self.i += 2
            else:
                end = self.i
                while end < len(s) and s[end] not in " \t\\#;&|()<>\n'\"$`":
                    end += 1
                end = max(end, self.i + 1)  # a '#' inside a word is a character
                self.add(Part("lit", s[self.i:end], False), s[self.i:end])
                self.i = end
        self.flush()
        return self.tokens

    def add(self, part: Part, source: str) -> None:
        self.parts.append(part)
        self.started = True
        self.line += source.count("\n")

    def flush(self) -> None:
        if self.started:
            self.tokens.append(Word(tuple(self.parts), self.line))
        self.parts, self.started = [], False

    def operator(self) -> None:
        s = self.s
        op = next(o for o in OPERATORS if s.startswith(o, self.i))
        word = Word(tuple(self.parts), self.line).literal if self.started else None
        if op == "(" and word is not None and ASSIGN_START.match(word):
            self.parts, self.started = [], False
            self.tokens.append(ArrayStart(word.rstrip("+=").rstrip("+"), word.endswith("+="), self.line))
            self.i += 1
            return
        if op in REDIRECTS and word is not None and word.isdigit():
            self.parts, self.started = [], False  # the file descriptor of 2>&1
        self.flush()
        self.tokens.append(Op(op, self.line))
        self.i += len(op)
        if op == "<<":
            self.heredoc()
        elif op == "\n":
            self.line += 1
            self.skip_heredocs()

    def heredoc(self) -> None:
        m = re.compile(r"-?[ \t]*(['\"]?)([A-Za-z0-9_]+)\1").match(self.s, self.i)
        if m:
            self.heredocs.append(m.group(2))
            self.i = m.end()

    def skip_heredocs(self) -> None:
        while self.heredocs:
            tag = self.heredocs.pop(0)
            m = re.compile(rf"^[ \t]*{re.escape(tag)}[ \t]*$", re.M).search(self.s, self.i)
            end = len(self.s) if m is None else m.end() + 1
            self.line += self.s.count("\n", self.i, end)
            self.i = end

    def closing(self, quote: str, start: int) -> int:
        end = self.s.find(quote, start)
        while quote == "`" and end > 0 and self.s[end - 1] == "\\":
            end = self.s.find(quote, end + 1)
        if end < 0:
            raise ConfigImportError([f"line {self.line}: a {quote} quote is never closed: not a complete shell script"])
        return end

    def double_quoted(self) -> None:
        s = self.s
        self.i += 1
        self.started = True
        text = []
        while True:
            if self.i >= len(s):
                raise ConfigImportError([f"line {self.line}: a \" quote is never closed: not a complete shell script"])
            c = s[self.i]
            if c == '"':
                break
            if c == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    text.append(s[self.i + 1])
                else:
                    self.line += 1
                self.i += 2
            elif c in "$`":
                if text:
                    self.parts.append(Part("lit", "".join(text), True))
                    text = []
                if c == "$":
                    self.dollar(quoted=True)
                else:
                    end = self.closing("`", self.i + 1)
                    self.add(Part("cmd", s[self.i + 1:end], True), s[self.i:end + 1])
                    self.i = end + 1
            else:
                self.line += c == "\n"
                text.append(c)
                self.i += 1
        self.parts.append(Part("lit", "".join(text), True))  # "" is an (empty) word of its own
        self.i += 1

    def dollar(self, *, quoted: bool) -> None:
        s, i = self.s, self.i
        if s.startswith("$((", i):
            end = self.balanced(i + 3, "(", ")", depth=2)
            self.add(Part("arith", s[i + 3:end - 1], quoted), s[i:end + 1])
            self.i = end + 1
        elif s.startswith("$(", i):
            end = self.balanced(i + 2, "(", ")")
            self.add(Part("cmd", s[i + 2:end], quoted), s[i:end + 1])
            self.i = end + 1
        elif s.startswith("${", i):
            end = self.balanced(i + 2, "{", "}")
            self.add(Part("param", s[i + 2:end], quoted), s[i:end + 1])
            self.i = end + 1
        elif m := NAME.match(s, i + 1):
            self.add(Part("param", m.group(0), quoted), m.group(0))
            self.i = m.end()
        elif i + 1 < len(s) and s[i + 1] in SPECIAL:
            self.add(Part("param", s[i + 1], quoted), s[i:i + 2])
            self.i = i + 2
        else:
            self.add(Part("lit", "$", quoted), "$")
            self.i = i + 1

    def balanced(self, start: int, open_: str, close: str, depth: int = 1) -> int:
        """The index of the `close` that ends a construct opened `depth` times before `start` (quotes skipped)."""
        s, i = self.s, start
        while i < len(s):
            c = s[i]
            if c == "\\":
                i += 2
                continue
            if c in "'\"" and open_ == "(":
                end = s.find(c, i + 1)
                i = len(s) if end < 0 else end + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    return i
            i += 1
        raise ConfigImportError([f"line {self.line}: a ${open_} is never closed: not a complete shell script"])


def tokens(text: str) -> list[Token]:
    """The tokens of a script (CRLF line ends read as LF); ConfigImportError for an unclosed quote or expansion."""
    return _Lexer(text.replace("\r\n", "\n")).run()


def word_parts(text: str) -> tuple[Part, ...]:
    """The parts of one word written inside an expansion (the default of ${X:-"a b"}): quotes apply, blanks kept."""
    lexer = _Lexer(text)
    lexer.started = True
    while lexer.i < len(text):
        c = text[lexer.i]
        if c == "'":
            end = lexer.closing("'", lexer.i + 1)
            lexer.add(Part("lit", text[lexer.i + 1:end], True), "")
            lexer.i = end + 1
        elif c == '"':
            lexer.double_quoted()
        elif c == "$":
            lexer.dollar(quoted=False)
        else:
            end = lexer.i + 1
            while end < len(text) and text[end] not in "'\"$":
                end += 1
            lexer.add(Part("lit", text[lexer.i:end], False), "")
            lexer.i = end
    return tuple(lexer.parts)
