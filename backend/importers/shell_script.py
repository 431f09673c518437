"""A launch script read as data: the command that starts training, with the script's variables, arrays and branches
followed, and nothing run (no subprocess, no eval, no file read).

Megatron-LM's own examples (tests/fixtures/imports/megatron_examples/) build the command from bash arrays
(`MODEL_ARGS=(--num-layers 32 ...)`, `torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]}`), string
variables (`GPT_ARGS="..."` then `$GPT_ARGS`), `${VAR:-default}`, `$((a * b))`, `export`, and `if` / `case` on their
own values. The script is read as bash would run it with no arguments and an empty environment:
- a variable the script does not set is empty in a test (`[ -z "$X" ]` is true) and kept as written in a command
  word ("${NUM_LAYERS}"), so a flag that needs its value names it; `${X:-default}` is the default; `$#` is 0;
- `$(...)` and backquotes are never run: their text is kept as written, and a test on it is undecided;
- an `if` / `case` / `while` whose test cannot be decided here (a file test, a command's status, a value kept as
  written) has none of its branches read (a note says which, when they set variables or run python); `for` loops are
  not read; `exit` does not stop the reading (a launch script's guards are not the run);
- the training command is the last simple command that runs a `.py` script (`pretrain_*.py` preferred); a file of
  bare `--flags` lines is read as the arguments themselves.
Bounds: shell_expand.MAX_EXPANDED_CHARS characters produced in all (an array doubled by 40 assignments is refused, in
well under a second) and the parser's nesting limit (shell_parse.MAX_DEPTH).
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field

from backend.importers import shell_parse as sp
from backend.importers.import_result import ConfigImportError
from backend.importers.shell_expand import ASSIGNMENT, Variables, is_assignment
from backend.importers.shell_tests import Test, Undecided
from backend.importers.shell_words import Word, tokens

MAX_SCRIPT_BYTES = 256 << 10
"""A launch script is a few KB (Megatron-LM's longest example is 8 KB); the cap bounds the reading to a few seconds."""
DECLARE = frozenset({"export", "declare", "local", "readonly", "typeset"})
KEPT = re.compile(r"\$\{?[A-Za-z0-9_#@*]+\}?|\$\(.*?\)|`[^`]*`")


@dataclass
class LaunchCommand:
    words: list[str]
    """The command's words after expansion (launcher, script, arguments); empty when the script runs none."""
    line: int
    notes: list[str] = field(default_factory=list)
    defaults: list[frozenset[str]] = field(default_factory=list)
    """Per word, the variables the script does not set whose default (`${SLURM_NNODES:-1}`) the word holds: a value
    for the environment to decide, which a GPU count given on import may replace."""


class _Reader:
    def __init__(self):
        self.v = Variables()
        self.commands: list[tuple[list[tuple[str, frozenset[str]]], int]] = []
        self.notes: list[str] = []
        self.functions: set[str] = set()

    # ---- statements ------------------------------------------------------------------------------------------
    def run(self, nodes: list, condition: bool = False) -> bool | None:
        status: bool | None = True
        for node in nodes:
            status = self.and_or(node, condition)
        return status

    def and_or(self, node: sp.AndOr, condition: bool) -> bool | None:
        status = self.pipeline(node.first, condition)
        for op, pipe in node.rest:
            if status is None:
                return None
            if (op == "&&") == status:
                status = self.pipeline(pipe, condition)
        return status

    def pipeline(self, pipe: sp.Pipeline, condition: bool) -> bool | None:
        status = None
        for command in pipe.commands:
            status = self.command(command, condition)
        return status if status is None or not pipe.negate else not status

    def command(self, node, condition: bool) -> bool | None:
        if isinstance(node, sp.Simple):
            return self.simple(node, condition)
        if isinstance(node, sp.DoubleBracket):
            return self.decide(lambda: Test(self.v, node.tokens, double=True).evaluate())
        if isinstance(node, sp.If):
            return self.if_(node)
        if isinstance(node, sp.Case):
            return self.case(node)
        if isinstance(node, sp.Loop):
            return self.loop(node)
        if isinstance(node, sp.Function):
            self.functions.add(node.name)
            return True
        saved = copy.deepcopy(self.v) if node.subshell else None
        status = self.run(node.body, condition)
        if saved:
            saved.budget, self.v = self.v.budget, saved  # a subshell's variables stay in it; what it spent does not
        return status

    def decide(self, test) -> bool | None:
        try:
            return test()
        except Undecided:
            return None

    def if_(self, node: sp.If) -> bool:
        for condition, body in node.branches:
            status = self.run(condition, condition=True)
            if status is None:
                self.skipped(node, "if", [b for _, b in node.branches] + [node.orelse or []])
                return True
            if status:
                self.run(body)
                return True
        if node.orelse is not None:
            self.run(node.orelse)
        return True

    def case(self, node: sp.Case) -> bool:
        value = self.v.expand(node.word, test=True)
        for patterns, body in node.items:
            for pattern in patterns:
                pat = self.v.expand(pattern, test=True)
                if not (value.known and pat.known):
                    self.skipped(node, "case", [b for _, b in node.items])
                    return True
                quoted = any(p.quoted for p in pattern.parts)
                if value.text == pat.text if quoted else fnmatch.fnmatchcase(value.text, pat.text):
                    self.run(body)
                    return True
        return True

    def loop(self, node: sp.Loop) -> bool:
        if node.kind != "for":
            status = self.run(node.condition, condition=True)
            if status is (node.kind == "until"):
                return True
        self.skipped(node, node.kind, [node.body])
        return True

    def skipped(self, node, kind: str, bodies: list[list]) -> None:
        """A note for branches not read, when they would have set a variable or run python."""
        names, runs = set(), False
        for body in bodies:
            for item in _simple_commands(body):
                for word in item.items:
                    if isinstance(word, sp.ArrayAssign):
                        names.add(word.name)
                    elif (m := ASSIGNMENT.match(word.parts[0].text if word.parts else "")) and not word.parts[0].quoted:
                        names.add(m.group(1))
                    elif "".join(p.text for p in word.parts).endswith(".py"):
                        runs = True
        if names or runs:
            what = ", ".join(sorted(names)[:6]) + (" ..." if len(names) > 6 else "")
            self.notes.append(f"line {node.line}: the {kind} tests what a script read as data cannot know (a file, a "
                              f"command, an argument): its body was not read" + (f" (it sets {what})" if names else "")
                              + (" (it runs python)" if runs else ""))

    def simple(self, node: sp.Simple, condition: bool) -> bool | None:
        items = node.items
        k = 0
        while k < len(items) and (isinstance(items[k], sp.ArrayAssign) or is_assignment(items[k])):
            k += 1
        if k == len(items):
            for item in items:
                self.v.assign(item)
            return True
        first = items[k].literal if isinstance(items[k], Word) else None
        if first in DECLARE:
            for item in items[k + 1:]:
                if isinstance(item, sp.ArrayAssign) or is_assignment(item):
                    self.v.assign(item)
            return True
        split = [f for item in items[k:] if isinstance(item, Word) for f in self.v.split(item)]
        words = [text for text, _ in split]
        if not words:
            return True
        name = words[0]
        if name in ("[", "test"):
            args = [item for item in items[k + 1:] if isinstance(item, Word)]
            if name == "[" and args and args[-1].literal == "]":
                args = args[:-1]
            return self.decide(lambda: Test(self.v, args, double=False).evaluate())
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name == "unset":
            for var in words[1:]:
                self.v.vars.pop(var, None)
            return True
        if condition:
            return None
        if name not in self.functions and name not in ("exit", "return", "source", ".", "eval", "echo", "printf"):
            self.commands.append((split, node.line))
        return True


def _simple_commands(nodes: list):
    """Every simple command in a body, nested ones included (iterative: the parser bounds the depth anyway)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, sp.AndOr):
            stack += [node.first] + [p for _, p in node.rest]
        elif isinstance(node, sp.Pipeline):
            stack += node.commands
        elif isinstance(node, sp.Simple):
            yield node
        elif isinstance(node, sp.If):
            stack += [n for c, b in node.branches for n in c + b] + (node.orelse or [])
        elif isinstance(node, sp.Case):
            stack += [n for _, b in node.items for n in b]
        elif isinstance(node, (sp.Loop, sp.Group)):
            stack += node.body
        elif isinstance(node, sp.Function):
            stack.append(node.body)


def read(text: str) -> LaunchCommand:
    """The training command of a launch script (or the flags of a file of them); ConfigImportError with the line."""
    size = len(text.encode("utf-8", "replace"))
    if size > MAX_SCRIPT_BYTES:
        raise ConfigImportError([f"the script is {size:,} bytes, over the {MAX_SCRIPT_BYTES:,}-byte limit for a launch "
                                 "script"])
    reader = _Reader()
    reader.run(sp.parse(tokens(text)))
    runs = [(w, line) for w, line in reader.commands if any(t.endswith(".py") for t, _ in w)]
    preferred = [(w, line) for w, line in runs if any(t.endswith(".py") and t.rsplit("/", 1)[-1].startswith("pretrain")
                                                      for t, _ in w)]
    if preferred or runs:
        split, line = (preferred or runs)[-1]
    else:
        flag_lines = [(w, line) for w, line in reader.commands if w[0][0].startswith("--")]
        split = [f for w, _ in flag_lines for f in w]
        line = flag_lines[0][1] if flag_lines else 0
        if not split and reader.commands:
            seen = ", ".join(f"{w[0][0]!r} (line {n})" for w, n in reader.commands[:4])
            raise ConfigImportError([f"no training command found: the script runs no python script (pretrain_gpt.py) "
                                     f"and holds no --arguments; it runs {seen}"])
    words = [t for t, _ in split]
    kept = sorted({m.group(0) for w in words for m in KEPT.finditer(w)})
    notes = list(reader.notes)
    if kept:
        notes.append("kept as written (the script's arguments, environment or commands, unknown here): "
                     + ", ".join(kept[:8]) + (" ..." if len(kept) > 8 else ""))
    return LaunchCommand(words, line, notes, [d for _, d in split])
