"""The parallel dimensions in the store. Every field of the dimension table (backend/spec/dims.py) is kept in
`experiments.degrees_json` ({spec field: value}, written with the spec, revision 0011); rows, sorts and the export
read each as a typed SQL expression under its column name (`schedule` for pp_schedule), the same on SQLite and
PostgreSQL. A run stored before a dimension existed has no key for it and reads the field's default, as its spec
does. No degree needs a column or a migration of its own."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from sqlalchemy import ColumnElement, func, literal

from backend.spec.dims import DIMS, Dim, SpecField, spec_fields
from db.models import Experiment


def field_sql(f: SpecField) -> ColumnElement:
    """One field's value: degrees_json[name] typed as the field, its default where a row has no such key."""
    item = Experiment.degrees_json[f.name]
    value = item.as_boolean() if f.kind is bool else item.as_integer() if f.kind is int else item.as_string()
    if f.default is None:
        return value
    default = str(f.default) if isinstance(f.default, StrEnum) else f.default
    return func.coalesce(value, literal(default, value.type), type_=value.type)


def columns(dims: Sequence[Dim] = DIMS) -> dict[str, ColumnElement]:
    """column name -> its SQL expression, for every field of the dimensions."""
    return {f.key: field_sql(f) for f in spec_fields(dims)}


def spec_values(parallel: object, dims: Sequence[Dim] = DIMS) -> dict[str, object]:
    """What degrees_json holds for a (validated) ParallelSpec: {field: value as JSON}."""
    return {f.name: _json(getattr(parallel, f.name)) for f in spec_fields(dims)}


def _json(value: object) -> object:
    return str(value) if isinstance(value, StrEnum) else value


DEGREE_COLUMNS = columns(DIMS)
"""The store's expression for each dimension column (db.queries.ROW_KEYS and db.export.EXP_COLUMNS name them)."""


def column(key: str) -> ColumnElement:
    """A row key's expression: a dimension's from degrees_json, else the experiments column of that name."""
    return DEGREE_COLUMNS[key].label(key) if key in DEGREE_COLUMNS else getattr(Experiment, key)
