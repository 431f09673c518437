"""The importer registry: every framework ShardLab imports configs and logs from, one entry each (entry.Importer, in
a module of its own). Everything that lists frameworks derives from `IMPORTERS`, read when it is asked (so a test
may add an entry and take it away): `import-config` / `import-run`'s --format choices and help, auto-detection and
its error, the Import config box's Format select, labels and help, import-run's log parser and rank mapping, and
through ImportedConfig.framework the store's `source_framework`, the `imported:<name>` tag and the export.

A new framework: its module (importers/<name>.py with `IMPORTER`), its line below, its fixtures
(docs/ARCHITECTURE.md, "A new importer")."""

from __future__ import annotations

from collections.abc import Callable

from backend.importers import deepspeed, megatron, torchtitan
from backend.importers.entry import Clue, Importer, Probe, SourceFormat

IMPORTERS: tuple[Importer, ...] = (torchtitan.IMPORTER, megatron.IMPORTER, deepspeed.IMPORTER)
"""In the order they are listed (--format choices, the Format select); detection orders by each clue's `order`."""


def names() -> tuple[str, ...]:
    return tuple(i.name for i in IMPORTERS)


def by_name(name: str) -> Importer:
    """The importer called `name`; KeyError when none is."""
    for i in IMPORTERS:
        if i.name == name:
            return i
    raise KeyError(f"no importer {name!r} (importers: {', '.join(names())})")


def clues() -> list[tuple[Clue, Importer]]:
    """Every importer's clues, in the order detection tries them."""
    return sorted(((c, i) for i in IMPORTERS for c in i.detect), key=lambda ci: ci[0].order)


def sniff(probe: Probe) -> tuple[Importer, SourceFormat] | None:
    """The importer and format the first holding clue names; None when none holds."""
    for clue, importer in clues():
        if clue.holds(probe):
            return importer, importer.source_format(clue.source_format)
    return None


def what_each_reads() -> str:
    """"torchtitan: a job .toml or ...; deepspeed: ds_config.json with --model-config", in the CLI's words."""
    return "; ".join(f"{i.name}: {i.reads}" + (" with --model-config" if i.needs_model_config else "")
                     for i in IMPORTERS)


def undetected(name: str) -> str:
    """Detection's error: the --format values and what each reads."""
    return f"cannot tell which framework {name!r} is for: give --format {'|'.join(names())} ({what_each_reads()})"


def source_formats() -> dict[str, tuple[str, ...]]:
    """{framework: every source_format value its imports report}."""
    return {i.name: tuple(n for f in i.formats for n in (f.name, *f.reports)) for i in IMPORTERS}


def labels_where(takes: Callable[[SourceFormat], bool]) -> str:
    """The labels of the importers with a format that `takes` (a --vocab, a --seq), joined: "Megatron-LM / NeMo"."""
    return " / ".join(i.label for i in IMPORTERS if any(takes(f) for f in i.formats))


def model_config_uses() -> list[str]:
    """What the model's config.json does for each framework's configs."""
    return [i.model_config_use for i in IMPORTERS]
