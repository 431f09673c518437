"""A throwaway PostgreSQL server for the store tests: Debian's `postgresql` binaries, a temporary data
directory, a free port on 127.0.0.1, trust auth; one server per test session, one database per test.

Measured here (Debian 12, PostgreSQL 15.18, 2 shared cores): initdb --no-sync ~2.3 s, pg_ctl start -w
~0.2 s, CREATE DATABASE ... TEMPLATE (migrated template) ~0.1 s, stop ~0.2 s. postgres refuses to run as
root, so as root the server runs as the `postgres` user (`runuser -u postgres`, the user Debian's package
creates); as any other user it runs as that user.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

TEMPLATE = "shardlab_template"


def bindir() -> Path | None:
    """Where initdb/pg_ctl live: $SHARDLAB_PG_BINDIR, else the newest /usr/lib/postgresql/*/bin, else PATH."""
    env = os.environ.get("SHARDLAB_PG_BINDIR")
    if env:
        return Path(env)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if found:
        return Path(found[-1])
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def unavailable_reason() -> str | None:
    """Why no server can be started here (None when it can)."""
    b = bindir()
    if b is None or not (b / "initdb").exists() or not (b / "pg_ctl").exists():
        return "PostgreSQL server binaries not found (apt-get install postgresql; `make test` does)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -r requirements.txt)"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and no `postgres` user to run the server as (postgres refuses root)"
        if shutil.which("runuser") is None:
            return "running as root and no `runuser` to drop to the postgres user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self) -> None:
        self.bin = bindir()
        self.root = Path(tempfile.mkdtemp(prefix="shardlab-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_root = os.geteuid() == 0

    def _cmd(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if self.as_root else list(args)

    def start(self) -> PgServer:
        if self.as_root:
            shutil.chown(self.root, "postgres")
        self.root.chmod(0o755)
        subprocess.run(self._cmd(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                                 "-E", "UTF8", "--no-sync"), check=True, capture_output=True, timeout=120)
        self.resume()
        return self

    def pause(self) -> None:
        """Stop the server, keeping its data (a real outage: clients see connections refused until resume)."""
        subprocess.run(self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60",
                                 "stop"), check=True, capture_output=True, timeout=90)

    def resume(self) -> None:
        """Start the server (again) on the same port and data."""
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=300 "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        subprocess.run(self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                                 str(self.root / "server.log"), "-w", "-t", "60", "start"),
                       check=True, capture_output=True, timeout=90)

    def stop(self) -> None:
        subprocess.run(self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"),
                       capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(sql)

    def make_template(self) -> None:
        """A database migrated to head that every test database is copied from (saves the migration per test)."""
        from db.session import forget_engines, open_db

        self.admin(f"CREATE DATABASE {TEMPLATE}")
        open_db(self.url(TEMPLATE))
        forget_engines()  # a template must have no open connections when it is copied

    def new_database(self, *, blank: bool = False) -> str:
        name = f"t_{uuid.uuid4().hex[:16]}"
        self.admin(f"CREATE DATABASE {name} TEMPLATE {'template0' if blank else TEMPLATE}")
        return name

    def drop_database(self, name: str) -> None:
        self.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
