"""The dashboard's worker state folder on a shared host (issue 31 item 7): `worker_ctl.ensure_worker`, which runs on
every page, never writes through a symlink someone planted, and uses only a private folder of this user."""

from __future__ import annotations

import os
import tempfile

import pytest

from dashboard import worker_ctl
from db.session import open_db


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """The temp folder the dashboard uses, under tmp_path; a worker start is recorded, never made."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("SHARDLAB_NO_WORKER", raising=False)
    spawned: list[str] = []
    monkeypatch.setattr(worker_ctl, "_spawn", lambda url, log: spawned.append(url) or 4242)
    return tmp_path, spawned


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


@pytest.mark.parametrize("name", ["worker.pid", "worker.lock"])
def test_a_planted_symlink_in_the_state_folder_is_never_followed(tmp_root, name):
    tmp_path, spawned = tmp_root
    url = f"sqlite:///{tmp_path / 's.db'}"
    victim = _victim(tmp_path)
    (worker_ctl.state_dir(url) / name).symlink_to(victim)
    with pytest.raises(worker_ctl.UnsafeStateDir, match="is a symlink"):
        worker_ctl.ensure_worker(open_db(url), url)
    assert victim.read_text() == "precious\n"  # before: the worker's pid (worker.pid) or nothing at all (worker.lock)
    assert spawned == []  # nothing started that could not be remembered


def test_the_state_folder_is_private_to_this_user(tmp_root):
    tmp_path, spawned = tmp_root
    url = f"sqlite:///{tmp_path / 's.db'}"
    status = worker_ctl.ensure_worker(open_db(url), url)
    assert status.started_now and spawned == [url]
    d = worker_ctl.state_dir(url)
    for level in (d, d.parent):
        info = os.lstat(level)
        assert info.st_uid == os.geteuid() and info.st_mode & 0o777 == 0o700, (level, oct(info.st_mode))
    assert d.parent.name == f"shardlab-ui-{os.geteuid()}" and d.parent.parent == tmp_path / "tmp"
    assert (d / "worker.pid").read_text() == "4242" and os.stat(d / "worker.pid").st_mode & 0o077 == 0


def test_a_planted_or_shared_state_folder_is_refused(tmp_root):
    tmp_path, spawned = tmp_root
    url = f"sqlite:///{tmp_path / 's.db'}"
    base = tmp_path / "tmp" / f"shardlab-ui-{os.geteuid()}"
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o700)
    base.symlink_to(elsewhere)  # another user's folder in the user's place
    with pytest.raises(worker_ctl.UnsafeStateDir, match="is a symlink"):
        worker_ctl.ensure_worker(open_db(url), url)
    base.unlink()
    base.mkdir()
    os.chmod(base, 0o777)  # made by someone for everyone: anything may have been planted inside
    with pytest.raises(worker_ctl.UnsafeStateDir, match="mode 777"):
        worker_ctl.ensure_worker(open_db(url), url)
    if os.geteuid() == 0:  # only root can give a folder away: the other user's own folder
        os.chmod(base, 0o700)
        os.chown(base, 65534, 65534)
        with pytest.raises(worker_ctl.UnsafeStateDir, match="belongs to uid 65534"):
            worker_ctl.ensure_worker(open_db(url), url)
    assert spawned == [] and list(elsewhere.iterdir()) == []
