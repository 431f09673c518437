"""Who may use a shared dashboard, and with which rights (pure Python: dashboard/serve.py checks it before Streamlit
starts, dashboard/access.py on every page and in every write).

`.streamlit/secrets.toml` (or ~/.streamlit/secrets.toml; the project's file wins, as in Streamlit) holds the
allow-list beside the login:

    [access]
    operators = ["alice@example.com", "@ml-infra.example.com"]   # may submit, cancel, re-run, tag, delete, calibrate
    viewers = ["@example.com"]                                  # may look: every page, plans, predictions, exports
    user_header = "X-Forwarded-Email"                           # trusted-proxy mode: the header naming the user

An entry is a user as the identity provider names them (an e-mail address, compared case-insensitively) or "@domain":
every address of exactly that domain (not its subdomains). Operators may also view. Anyone else is refused.

The login cookie is signed with [auth] cookie_secret: a guessable secret lets anyone forge a login, so it must be at
least 32 random characters, 128 bits (`secrets.token_hex(32)` gives 64 hex digits, 256 bits).
"""

from __future__ import annotations

import math
import string
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

DEFAULT_USER_HEADER = "X-Forwarded-Email"
"""What oauth2-proxy (and most authenticating proxies) set to the signed-in user's e-mail address."""
MIN_SECRET_CHARS = 32
MIN_SECRET_DISTINCT = 8
MIN_SECRET_BITS = 128
SECRET_HINT = "python -c 'import secrets; print(secrets.token_hex(32))'"


class Role(StrEnum):
    VIEWER = "viewer"
    """Sees every page, plans and predictions, downloads exports; changes nothing in the store."""
    OPERATOR = "operator"
    """Also submits, cancels, re-runs, tags, deletes runs and stores calibrations."""


@dataclass(frozen=True)
class Policy:
    operators: tuple[str, ...] = ()
    viewers: tuple[str, ...] = ()
    user_header: str = DEFAULT_USER_HEADER

    @property
    def configured(self) -> bool:
        return bool(self.operators or self.viewers)

    def role(self, user: str | None) -> Role | None:
        """The user's role, or None: not on the list."""
        if not user:
            return None
        if any(matches(e, user) for e in self.operators):
            return Role.OPERATOR
        if any(matches(e, user) for e in self.viewers):
            return Role.VIEWER
        return None


def matches(entry: str, user: str) -> bool:
    """'@example.com' matches 'a@example.com' (not 'a@evil-example.com' or 'a@sub.example.com'); others match exactly,
    ignoring case and surrounding blanks."""
    entry, user = entry.strip().lower(), user.strip().lower()
    if entry.startswith("@"):
        return user.count("@") == 1 and user.endswith(entry) and len(user) > len(entry)
    return user == entry


def parse_policy(section: Any) -> tuple[Policy, list[str]]:
    """([access] as a Policy, its problems); an absent section is an empty policy (nobody listed)."""
    if section is None:
        return Policy(), []
    if not isinstance(section, dict):
        return Policy(), ["[access] must be a table with operators = [...] and / or viewers = [...]"]
    problems, lists = [], {}
    for key in ("operators", "viewers"):
        value = section.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"[access] {key} must be a list of e-mail addresses or @domains (got {value!r})")
            value = []
        for v in value:
            if (why := entry_problem(v)) is not None:
                problems.append(f"[access] {key}: {why}")
        lists[key] = tuple(v.strip() for v in value if entry_problem(v) is None)
    unknown = sorted(set(section) - {"operators", "viewers", "user_header"})
    if unknown:
        problems.append(f"[access] has unknown keys {', '.join(unknown)} (known: operators, viewers, user_header)")
    header = section.get("user_header", DEFAULT_USER_HEADER)
    if not isinstance(header, str) or not header.strip():
        problems.append(f"[access] user_header must be a header name (got {header!r})")
        header = DEFAULT_USER_HEADER
    return Policy(operators=lists["operators"], viewers=lists["viewers"], user_header=header.strip()), problems


def entry_problem(entry: str) -> str | None:
    e = entry.strip()
    if not e or e in ("*", "@") or "*" in e:
        return f"{entry!r} would match anyone or no one: list e-mail addresses or @domains, no wildcards"
    if e.startswith("@") and ("." not in e[1:] or "@" in e[1:]):
        return f"{entry!r} is not an @domain (like @example.com)"
    return None


def cookie_secret_problem(secret: Any) -> str | None:
    """Why [auth] cookie_secret is too weak to sign login cookies, or None: under 32 characters, fewer than 8 different
    ones, a repeated pattern, or under 128 bits by its alphabet (32 hex digits are 128 bits; 32 decimal digits 106)."""
    if not isinstance(secret, str) or not secret:
        return "[auth] cookie_secret is missing"
    why = None
    period = next((p for p in range(1, len(secret) // 2 + 1) if secret == (secret[:p] * len(secret))[:len(secret)]),
                  None)
    if len(secret) < MIN_SECRET_CHARS:
        why = f"is {len(secret)} character{'s' * (len(secret) != 1)} long"
    elif len(set(secret)) < MIN_SECRET_DISTINCT:
        why = f"has only {len(set(secret))} different characters"
    elif period is not None:
        why = f"repeats {secret[:period]!r}"
    elif (bits := len(secret) * math.log2(_alphabet(secret))) < MIN_SECRET_BITS:
        why = f"holds about {bits:.0f} bits ({len(secret)} characters of a {_alphabet(secret)}-letter alphabet)"
    if why is None:
        return None
    return (f"[auth] cookie_secret {why}: it signs the login cookie, so a guessable one lets anyone forge a login; use "
            f"at least {MIN_SECRET_CHARS} random characters, {MIN_SECRET_BITS} bits ({SECRET_HINT})")


def _alphabet(secret: str) -> int:
    """The size of the smallest common alphabet the secret is drawn from (hex, decimal, letters, printable)."""
    chars = set(secret)
    if chars <= set(string.digits):
        return 10
    if chars <= set(string.hexdigits.lower()) or chars <= set(string.hexdigits.upper() + string.digits):
        return 16
    size = sum(len(cls) for cls in (string.digits, string.ascii_lowercase, string.ascii_uppercase) if chars & set(cls))
    return size + (32 if chars - set(string.ascii_letters + string.digits) else 0)


def read_secrets(paths: list[Path]) -> tuple[dict[str, Any], list[str]]:
    """The secrets Streamlit would see: each file's top-level sections, the first path's winning (the project's file
    is listed first, and Streamlit loads it last); problems for unreadable files."""
    merged: dict[str, Any] = {}
    problems = []
    for path in reversed(paths):
        if not path.exists():
            continue
        try:
            merged.update(tomllib.loads(path.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as e:
            problems.append(f"{path}: unreadable ({e})")
    return merged, problems
