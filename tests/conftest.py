"""The suite's shared set-up: test kinds, the environment every test runs in, no stray workers, the experiment
store on SQLite and PostgreSQL, and the farm of rank programs (tests/helpers/farm.py).

Kinds (pytest.ini; `make test` runs them all in one pytest-xdist run, in the order tests/helpers/schedule.py gives):
- unit: one process, pure Python (torch in-process, Streamlit's AppTest, the worker's loop on threads, the CLI's
  `main(argv)`);
- multiprocess: the code under test runs in several processes: torchrun ranks on gloo, trace ranks, a worker, the
  CLI or the dashboard in a subprocess;
- e2e: against a real browser, SLURM cluster, PostgreSQL server or GPU. The PostgreSQL variant of a store test
  (`store_urls`' postgresql parameter) is end-to-end too.
A test file holds one subject; its tests may be of several kinds. A test's kind is the strongest of: its own mark
(`@pytest.mark.multiprocess` on the test, its class or the module's `pytestmark`), else its folder's default
(tests/unit, tests/multiprocess, tests/e2e); the kind of the fixtures it uses (FIXTURE_KINDS: the farm is
multiprocess, a PostgreSQL server e2e); and e2e for the `postgres` mark (store_urls' postgresql parameter).
`slow` marks tests that take tens of seconds, `heavy` unit tests of half a second or more; both stay out
of `make test-fast`.
"""

import os
import sys
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "multiprocess", "e2e")  # weakest first
FIXTURE_KINDS = {"farm": "multiprocess", "pg_server": "e2e"}
"""Fixtures that make a test of at least that kind, wherever it lives."""


def kind_of(item) -> str:
    """The kind of one collected test (see the module docstring)."""
    path = Path(str(item.path)).resolve()
    folder = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
    if folder not in KINDS:
        raise pytest.UsageError(f"{item.nodeid}: test files live in tests/unit, tests/multiprocess or tests/e2e")
    needed = [FIXTURE_KINDS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_KINDS]
    needed += ["e2e"] if item.get_closest_marker("postgres") else []
    marked = [k for k in KINDS if item.get_closest_marker(k)]
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid}: marked {' and '.join(marked)}: one kind per test")
    return max([marked[0] if marked else folder, *needed], key=KINDS.index)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test with its kind before `-m` selects (tryfirst: the mark plugin deselects after us)."""
    for item in items:
        kind = kind_of(item)
        if not item.get_closest_marker(kind):
            item.add_marker(getattr(pytest.mark, kind))
    from tests.helpers.farm import order_items
    from tests.helpers.schedule import group_and_order

    order_items(items)
    group_and_order(items)


def pytest_configure(config):
    """`--dist loadgroup` hands out tests/helpers/schedule.py's groups (pytest-xdist's own are lost: see there)."""
    from tests.helpers.schedule import share_groups_with_workers

    share_groups_with_workers(config)


def _scan_streamlit_components_once() -> None:
    """Every new AppTest scans all installed distributions' metadata for Streamlit v2 component manifests
    (streamlit 1.5x: testing/v1/app_test.py `_run` -> BidiComponentManager.discover_and_register_components): about
    1.2-2 s of a ~0.1 s page run, paid by each of the suite's AppTests. The server scans once at start-up; the suite
    scans once per process too (the installed packages do not change during a session)."""
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # a Streamlit without v2 components scans nothing per run
        return
    import functools

    scan = functools.cache(manifest_scanner.scan_component_manifests)
    manifest_scanner.scan_component_manifests = lambda max_workers=None: list(scan())


_scan_streamlit_components_once()
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in a pool of subprocesses sized to the CPUs; on 2 cores, ranks that each start a pool beside
# the other tests spent twice the CPU (tests/multiprocess/test_compiled_runs.py alone: 245 CPU-s with the pool,
# 131 without, warm FX graph cache). One thread compiles the same code.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The dashboard starts a worker when none is alive; in tests that worker would outlive the session.
os.environ.setdefault("SHARDLAB_NO_WORKER", "1")
# The worker measures this host for the 'cpu' profile before its first run (backend/bench/cpu_profile.py); the suite
# keeps that off (timings under test load, and the checkout's data/) except in the test that turns it on.
os.environ.setdefault("SHARDLAB_AUTO_HW_PROBE", "0")
# Every process the suite starts inherits this tag, so strays can be found (and only ours). Under pytest-xdist each
# worker extends the controller's tag with its id: a test that cleans up its session's job processes (test_slurm's
# env fixture) must never find, and kill, the runs of a test on the other worker.
SESSION_TAG = os.environ.setdefault("SHARDLAB_TEST_SESSION", uuid.uuid4().hex)
if os.environ.get("PYTEST_XDIST_WORKER") and not SESSION_TAG.endswith("-" + os.environ["PYTEST_XDIST_WORKER"]):
    SESSION_TAG = os.environ["SHARDLAB_TEST_SESSION"] = f"{SESSION_TAG}-{os.environ['PYTEST_XDIST_WORKER']}"


def _stray_workers() -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if p.pid != os.getpid() and "backend" in cmd and "worker" in cmd \
                    and (p.environ().get("SHARDLAB_TEST_SESSION") or "").startswith(SESSION_TAG) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    """No `python -m backend worker` started by this test session may outlive it: kill strays and fail.

    Under pytest-xdist (`make test` runs both passes with -n 2) a worker that finishes first could see its peer's live
    workers as strays: only the controller checks, after all of them, for every tag that extends its own."""
    import psutil

    if hasattr(session.config, "workerinput"):
        return
    strays = _stray_workers()
    if not strays:
        return
    lines = []
    for p in strays:
        try:
            lines.append(f"pid {p.pid}: {' '.join(p.cmdline())} (db {p.environ().get('SHARDLAB_DB_URL')})")
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(strays, timeout=5)
    sys.stderr.write("\nstray worker process(es) left by the test session (killed):\n  " + "\n  ".join(lines) + "\n")
    session.exitstatus = 1


# ---- the experiment store on SQLite and on PostgreSQL ------------------------------------------------

@pytest.fixture(scope="session")
def pg_server():
    """One real PostgreSQL server for the whole session (see tests/helpers/pg_server.py); skipped with the reason."""
    from tests.helpers.pg_server import PgServer, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = PgServer().start()
    try:
        server.make_template()
        yield server
    finally:
        from db.session import forget_engines

        forget_engines()
        server.stop()


class StoreUrls:
    """Database URLs of the backend under test, one per name: a SQLite file in tmp_path, or a fresh
    PostgreSQL database copied from the migrated template (`blank=True`: an empty one, for migrations)."""

    def __init__(self, backend: str, tmp_path, server=None) -> None:
        self.backend, self.tmp_path, self.server, self._urls, self._dbs = backend, tmp_path, server, {}, []

    def url(self, name: str = "store.db", *, blank: bool = False) -> str:
        if name not in self._urls:
            if self.server is None:
                self._urls[name] = f"sqlite:///{self.tmp_path / name}"
            else:
                db = self.server.new_database(blank=blank)
                self._dbs.append(db)
                self._urls[name] = self.server.url(db)
        return self._urls[name]

    def engine(self, name: str = "store.db"):
        from db.session import open_db

        return open_db(self.url(name))

    def close(self) -> None:
        if self.server is None:
            return
        from db.session import forget_engines

        forget_engines()
        for db in self._dbs:
            self.server.drop_database(db)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_urls(request, tmp_path):
    """The store tests run once on SQLite and once on a real PostgreSQL server."""
    server = request.getfixturevalue("pg_server") if request.param == "postgresql" else None
    urls = StoreUrls(request.param, tmp_path, server)
    yield urls
    urls.close()


# ---- the farm of rank programs (tests/helpers/farm.py) ----------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _farm_session(request, tmp_path_factory):
    """Start the farm for the jobs the selected tests declare, before the first test; at the end wait for it (the
    other pytest-xdist worker may still read it)."""
    from tests.helpers.farm import Farm, farm_root, jobs_of

    jobs = jobs_of(request.session.items)
    if not jobs:
        yield None
        return
    farm = Farm(farm_root(tmp_path_factory.getbasetemp()), jobs)
    farm.start()
    try:
        yield farm
        if farm.thread is not None:
            farm.thread.join()
    finally:
        farm.stop()


@pytest.fixture(scope="session")
def farm(_farm_session):
    """The session's farm: `farm.result(job)` for a job the test declares with `tests.helpers.farm.uses(job)`."""
    if _farm_session is None:
        pytest.fail("no test declares a farm job (tests.helpers.farm.uses)")
    return _farm_session
