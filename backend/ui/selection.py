"""Table selections held as ids, never as row positions.

Streamlit reports a dataframe selection as row positions of the frame it was made on, and keeps a keyed
widget's selection when the frame under it changes (a filter, a new sort, a new search). A position read
against the new frame then names another row, or none (IndexError). So each table is keyed by the ids it
shows: a different view is a different widget with an empty selection, positions are only ever read against
the frame they were made on, and the page keeps the selection as ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence


def view_key(prefix: str, ids: Sequence[Hashable]) -> str:
    """A widget key that changes whenever the shown ids (or their order) change."""
    digest = hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=6).hexdigest()
    return f"{prefix}_{digest}"


def picked_ids(rows: Iterable[int], ids: Sequence[Hashable]) -> list:
    """The ids at these row positions of the frame the selection was made on (positions outside it ignored)."""
    return [ids[i] for i in rows if 0 <= i < len(ids)]


def split_in_view(selected: Iterable[Hashable], in_view: Iterable[Hashable]) -> tuple[list, list]:
    """(selected ids still shown, selected ids the view no longer shows), each in selection order."""
    shown = set(in_view)
    kept, dropped = [], []
    for i in selected:
        (kept if i in shown else dropped).append(i)
    return kept, dropped


def dropped_message(dropped: Sequence[Hashable], why: str) -> str:
    """'#3, #7 left the selection: <why>.' for a visible note."""
    return f"{', '.join(f'#{i}' for i in dropped)} left the selection: {why}."
