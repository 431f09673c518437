"""Every Alembic revision that has ever been in main's history, in the order they appeared: id, file, what it changed,
the commit that added it, and the revision it is today (None: it is that revision itself).

Revision ids were reused: branches cut from the same main numbered their revisions alike, and each merge renumbered
one side, so a store written on the other side carries a stamp that means another change today. Those stores are
upgraded by db/migrations/audit.py (a stamp is trusted only as far as the store's tables bear it out). The rule
from here on: an id in this list is never used again, and a revision that has landed is never renumbered;
tests/unit/test_migration_history.py checks both against db/migrations/versions/ and this list, which only grows.
The stores each of these wrote are upgrade fixtures in tests/fixtures/stores/ (README.md there).
"""

from __future__ import annotations

from typing import NamedTuple


class Landed(NamedTuple):
    revision: str
    file: str
    change: str
    added_in: str
    today: str | None
    """The revision of today's chain that makes the same change (None: this entry is that revision)."""


LANDED: tuple[Landed, ...] = (
    Landed("0001", "0001_initial.py", "experiments, tags, rank results, comm, losses, timeline", "116aa10", None),
    Landed("0002", "0002_workers_requeue.py", "workers table, experiments.requeue_of", "116aa10", None),
    Landed("0003", "0003_export_summaries.py", "experiment_summaries, rank_results.comm_*", "116aa10", None),
    Landed("0004", "0004_calibrations.py", "calibrations (branch i13)", "9c110e8", "0005"),
    Landed("0004", "0004_experiment_kind.py", "experiments.kind (branch trace)", "5b10e14", None),
    Landed("0004", "0004_framework.py", "experiments.framework (branch i14)", "f588abd", "0006"),
    Landed("0005", "0005_calibrations.py", "calibrations", "5f2c49c", None),
    Landed("0006", "0006_framework.py", "experiments.framework", "5f2c49c", None),
    Landed("0007", "0007_step_time_predicted.py", "experiment_summaries.step_time_predicted_s", "074c010", "0008"),
    Landed("0007", "0007_run_uid_autoincrement.py", "experiments.run_uid, ids never reused", "c8dbc55", None),
    Landed("0008", "0008_step_time_predicted.py", "experiment_summaries.step_time_predicted_s", "20519f9", None),
    Landed("0009", "0009_context_parallel.py", "experiments.cp, cp_rotate, cp_load_balance (branch cp)", "bba3d1e",
           "0010"),
    Landed("0009", "0009_imported_runs.py", "imported runs' columns, calibrations.name / details_json", "7426cff",
           None),
    Landed("0010", "0010_context_parallel.py", "experiments.cp, cp_rotate, cp_load_balance", "2c58e3e", None),
    Landed("0011", "0011_degrees_json.py", "experiments.degrees_json: the parallel dimensions' fields (issue 33)",
           "8f788ce", None),
)
