"""The variables of a launch script and the expansion of its words, as data for `shell_script.py`: `$X`, `${X}`,
`${A[@]}` / `${A[i]}`, `${#X}`, `${X:-default}` (also `-`, `=`, `:=`, `+`, `?`), `$((...))` through shell_tests'
small integer parser, and bash's word splitting of unquoted expansions. `$(...)` and backquotes are never run: their
text is kept as written. What an expansion cannot know is marked (Value.known, Value.kept), and so are the defaults
of variables the script leaves to its environment (Value.defaults). Every expansion is paid for out of one budget,
so a script that doubles an array forty times is refused instead of filling memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backend.importers.import_result import ConfigImportError
from backend.importers.shell_parse import ArrayAssign
from backend.importers.shell_tests import arithmetic
from backend.importers.shell_words import Part, Word, word_parts

MAX_EXPANDED_CHARS = 1 << 20
"""What all expansions may produce (a launch script's produce a few KB); each word counts FIELD_COST more."""
FIELD_COST = 32
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
PARAM = re.compile(r"(#?)([A-Za-z_][A-Za-z0-9_]*|\d+|[#@*?$!-])(?:\[([^\]]*)\])?(.*)", re.S)


@dataclass
class Value:
    text: str | list[str]
    known: bool = True
    kept: bool = False
    """The text is the expansion as written (an unset variable, a command substitution): one word, never split."""
    defaults: frozenset[str] = frozenset()
    """Unset variables whose `${X:-default}` the value holds (see LaunchCommand.defaults)."""
    element_defaults: list[frozenset[str]] | None = None
    """The same per element, for an array's elements."""

    def per_element(self) -> list[tuple[str, frozenset[str]]]:
        items = self.text if isinstance(self.text, list) else [self.text]
        held = self.element_defaults or [self.defaults] * len(items)
        return list(zip(items, held, strict=False))


class Variables:
    """The script's variables (strings and arrays) as it has set them so far."""

    def __init__(self):
        self.vars: dict[str, str | list[str]] = {}
        self.unknown: set[str] = set()
        """Variables whose value holds text the reader cannot know (an argument, a command's output)."""
        self.kept: set[str] = set()
        """Variables whose whole value is an expansion kept as written (X=$(nproc)): one word, never split."""
        self.defaults: dict[str, frozenset[str] | list[frozenset[str]]] = {}
        """Per variable (per element of an array) the unset variables whose defaults it holds."""
        self.budget = MAX_EXPANDED_CHARS

    def assign(self, item: Word | ArrayAssign) -> None:
        """NAME=value, NAME+=value, NAME=(...), NAME+=(...)."""
        if isinstance(item, ArrayAssign):
            split = [f for w in item.elements for f in self.split(w)]
            known = all(self.expand(w).known for w in item.elements)
            old = self.vars.get(item.name, []) if item.append else []
            before = self.lookup(item.name, "@") if item.append else None
            held = ([d for _, d in before.per_element()] if before else []) + [d for _, d in split]
            self.set(item.name, (old if isinstance(old, list) else [old]) + [t for t, _ in split], known, held)
            return
        first = item.parts[0]
        m = ASSIGNMENT.match(first.text)
        rest = Word((Part("lit", first.text[m.end():], False),) + item.parts[1:], item.line)
        value = self.expand(rest)
        old = self.vars.get(m.group(1), "") if m.group(2) else ""
        before = self.lookup(m.group(1), "@") if m.group(2) else None
        if isinstance(old, list):
            held = [d for _, d in before.per_element()] + [value.defaults]
            self.set(m.group(1), old + [value.text], value.known, held)
        else:
            held = value.defaults | (before.defaults if before else frozenset())
            self.set(m.group(1), old + value.text, value.known, held)
            if value.kept and not old:
                self.kept.add(m.group(1))

    def set(self, name: str, value: str | list[str], known: bool,
            defaults: frozenset[str] | list[frozenset[str]] = frozenset()) -> None:
        self.vars[name] = value
        self.defaults[name] = defaults
        self.kept.discard(name)
        (self.unknown.discard if known else self.unknown.add)(name)

    def spend(self, n: int, line: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise ConfigImportError([f"line {line}: the script's variables expand to more than {MAX_EXPANDED_CHARS:,} "
                                     "characters: not a launch script ShardLab reads"])

    def expand(self, word: Word, *, test: bool = False) -> Value:
        """A word as one string (no splitting: an assignment's value, a test operand)."""
        text, known, defaults, kept = [], True, frozenset(), None
        for part in word.parts:
            value = self.part(part, test)
            known &= value.known
            defaults |= value.defaults
            text.append(" ".join(value.text) if isinstance(value.text, list) else value.text)
            if part.kind != "lit" or text[-1]:
                kept = value.kept if kept is None else kept and value.kept
        out = "".join(text)
        self.spend(len(out), word.line)
        return Value(out, known, kept=bool(kept), defaults=defaults)

    def split(self, word: Word) -> list[tuple[str, frozenset[str]]]:
        """A command word as bash splits it (unquoted expansions split on blanks, "${A[@]}" one word per element),
        each field with the unset variables whose defaults it holds."""
        fields: list[tuple[str, frozenset[str]]] = []
        current: str | None = None
        held: frozenset[str] = frozenset()

        def close() -> None:
            nonlocal current, held
            fields.append((current or "", held))
            current, held = None, frozenset()

        for part in word.parts:
            value = self.part(part, test=False)
            if part.kind == "lit" or (part.quoted and not isinstance(value.text, list)) or value.kept:
                text = " ".join(value.text) if isinstance(value.text, list) else value.text
                current, held = (current or "") + text, held | value.defaults
                continue
            if part.quoted:  # "${A[@]}"
                for i, (element, element_held) in enumerate(value.per_element()):
                    if i:
                        close()
                    current, held = (current or "") + element, held | element_held
                continue
            for j, (text, element_held) in enumerate(value.per_element()):
                if (j or text[:1].isspace()) and current is not None:
                    close()
                for i, piece in enumerate(text.split()):
                    if i:
                        close()
                    current, held = (current or "") + piece, held | element_held
                if text[-1:].isspace() and current is not None:
                    close()
        if current is not None:
            close()
        self.spend(sum(len(t) + FIELD_COST for t, _ in fields), word.line)
        return fields

    def part(self, part: Part, test: bool) -> Value:
        if part.kind == "lit":
            return Value(part.text)
        if part.kind == "cmd":
            return Value(f"$({part.text})", False, kept=True)
        if part.kind == "arith":
            result = arithmetic(self, part.text)
            used = [self.lookup(n, "@") for n in re.findall(r"[A-Za-z_]\w*", part.text)]
            defaults = frozenset().union(*(d for v in used if v is not None for _, d in v.per_element()))
            return Value(f"$(({part.text}))", False, kept=True) if result is None else Value(str(result),
                                                                                             defaults=defaults)
        return self.param(part.text, test)

    def param(self, text: str, test: bool) -> Value:
        kept = Value(f"${{{text}}}", False, kept=True)
        m = PARAM.fullmatch(text)
        if not m:
            return kept
        length, name, index, op = m.groups()
        value = self.lookup(name, index)
        if length:
            return kept if value is None else Value(str(len(value.text)))
        if not op:
            return value if value is not None else (Value("") if test else kept)
        o = re.fullmatch(r"(:?)([-=+?])(.*)", op, re.S)
        if not o:
            return kept
        colon, kind, default = o.groups()
        is_set = value is not None and (not colon or value.text not in ("", []))
        if kind == "+":
            return self.expand(Word(word_parts(default), 0), test=test) if is_set else Value("")
        if is_set:
            return value
        if kind == "?":
            return kept
        fallback = self.expand(Word(word_parts(default), 0), test=test)
        fallback.defaults |= {name}
        if kind == "=" and not index:
            self.set(name, fallback.text, fallback.known, fallback.defaults)
        return fallback

    def lookup(self, name: str, index: str | None) -> Value | None:
        """The value of $name / ${name[index]}; None when unset (a positional argument, the environment)."""
        if name == "#":
            return Value("0")
        if name in "@*":
            return Value([])
        if name == "?":
            return Value("0")
        if name not in self.vars:
            return None
        value, known, held = self.vars[name], name not in self.unknown, self.defaults.get(name, frozenset())
        items = value if isinstance(value, list) else [value]
        per = held if isinstance(held, list) and len(held) == len(items) else [frozenset().union(*held) if
                                                                               isinstance(held, list)
                                                                               else held] * len(items)
        if index in ("@", "*"):
            return Value(items, known, defaults=frozenset().union(*per), element_defaults=per)
        i = 0 if index is None else arithmetic(self, index)
        if i is None or not -len(items) <= i < len(items):
            return None
        return Value(items[i], known, kept=name in self.kept, defaults=per[i])


def is_assignment(item) -> bool:
    """A word `NAME=...` / `NAME+=...` (unquoted name)."""
    return (isinstance(item, Word) and bool(item.parts) and item.parts[0].kind == "lit" and not item.parts[0].quoted
            and ASSIGNMENT.match(item.parts[0].text) is not None)
