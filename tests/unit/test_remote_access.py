"""Remote access: `make run` (dashboard/serve.py) refuses a non-loopback bind unless login or a trusted proxy
is configured on purpose; hostile names, tags and endpoints never reach a command line or batch script. As a program
(multiprocess): a non-loopback bind is refused, the trusted-proxy opt-out starts it."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from backend.spec import validate_spec
from dashboard.serve import is_loopback, remote_access_problem
from db.session import REPO

HOSTILE = ["$(rm -rf /)", "`touch /tmp/pwned`", "a'b\"c", "line1\nline2", "; -- DROP", "x && reboot", "--help", "$HOME"]
TINY = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 64},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2}}
SECRET = "9f2c4e7a1b8d3f6052a9c1e4b7d0f3a6"  # hex: 16 different characters (issue 31: "a" was accepted)
AUTH = f"""[auth]
redirect_uri = "https://shardlab.example.com/oauth2callback"
cookie_secret = "{SECRET}9c8b7a6d5e4f"
client_id = "shardlab"
client_secret = "s3cret"
server_metadata_url = "https://idp.example.com/.well-known/openid-configuration"

[access]
operators = ["alice@example.com"]
viewers = ["@example.com"]
"""


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2", "[::1]"])
def test_loopback_is_always_allowed(host):
    assert is_loopback(host) and remote_access_problem(host, env={}, paths=[]) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "", "10.1.2.3", "::", "shardlab.internal"])
def test_other_addresses_are_refused_without_auth_or_proxy_opt_out(host):
    problem = remote_access_problem(host, env={}, paths=[])
    assert problem and "SHARDLAB_TRUSTED_PROXY=1" in problem and "[auth]" in problem


def test_trusted_proxy_opt_out_must_be_exactly_1():
    assert remote_access_problem("0.0.0.0", env={"SHARDLAB_TRUSTED_PROXY": "1"}, paths=[]) is None
    assert remote_access_problem("0.0.0.0", env={"SHARDLAB_TRUSTED_PROXY": "yes please"}, paths=[]) is not None


def test_a_complete_auth_section_allows_and_an_incomplete_one_says_what_is_missing(tmp_path):
    secrets = tmp_path / "secrets.toml"
    secrets.write_text(AUTH)
    assert remote_access_problem("0.0.0.0", env={}, paths=[secrets]) is None
    secrets.write_text(AUTH.replace(f'cookie_secret = "{SECRET}9c8b7a6d5e4f"\n', ""))
    assert "lacks cookie_secret" in remote_access_problem("0.0.0.0", env={}, paths=[secrets])
    provider = AUTH.replace('client_id = "shardlab"\n', "").replace('client_secret = "s3cret"\n', "")
    provider = provider.replace('server_metadata_url = "https://idp.example.com/.well-known/openid-configuration"\n',
                                "")
    secrets.write_text(provider + '[auth.okta]\nclient_id = "c"\nclient_secret = "s"\nserver_metadata_url = '
                                  '"https://o"\n')
    assert remote_access_problem("0.0.0.0", env={}, paths=[secrets]) is None


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_names_and_tags_never_reach_a_command_line_or_batch_script(text, tmp_path):
    from backend.cluster.script import build_script
    from backend.cluster.slurm_config import SlurmConfig
    from backend.launch.torchrun import build_command

    spec, problems = validate_spec({**TINY, "name": text, "parallel": {"strategy": "ddp", "world_size": 2}})
    if "\n" in text:  # issue 21: names are plain text, a newline is refused before anything is stored or launched
        assert spec is None and "control character U+000A" in problems[0]
        return
    assert not problems and spec.name == text  # stored verbatim, as data
    cmd = build_command(spec, tmp_path / "spec.json", tmp_path)
    assert all(text not in arg for arg in cmd)
    slurm, _ = validate_spec({**TINY, "name": text, "parallel": {"strategy": "ddp", "world_size": 2},
                              "runtime": {"executor": "slurm", "nnodes": 2}})
    script = build_script(slurm, SlurmConfig(), experiment_id=3, workdir=tmp_path / "3")
    assert text not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_values_are_refused_by_the_spec_and_the_cluster_config(text):
    from pydantic import ValidationError

    from backend.cluster.slurm_config import SlurmConfig

    _, problems = validate_spec({**TINY, "parallel": {"world_size": 2},
                                 "runtime": {"nnodes": 2, "rdzv_endpoint": f"{text}:29500"}})
    assert any("is not host:port" in p for p in problems)
    for field in ({"partition": text}, {"account": text}, {"extra_sbatch": [f"#SBATCH --x={text}"]},
                  {"time_limit": text}):
        with pytest.raises(ValidationError):
            SlurmConfig(**field)


def test_the_cli_passes_a_hostile_name_as_one_argument_to_the_store(tmp_path, capsys):
    from backend.cli import main
    from db import queries as q
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'h.db'}"
    name = HOSTILE[0] + HOSTILE[4]
    plain = [t for t in HOSTILE if "\n" not in t]  # issue 21: a newline is refused (exit 2), the rest is stored as data
    flags = ["submit", "--db", url, "--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16",
             "--vocab", "64", "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]
    assert main([*flags, "--name", HOSTILE[0] + HOSTILE[3]]) == 2 and main([*flags, f"--tag={HOSTILE[3]}"]) == 2
    capsys.readouterr()
    assert main([*flags, "--name", name, *[f"--tag={t}" for t in plain]]) == 0
    row = q.get_experiment(open_db(url), int(capsys.readouterr().out))
    assert row["name"] == name and sorted(row["tags"]) == sorted(plain)
    assert not Path("/tmp/pwned").exists()
    assert shlex.quote(name) != name  # (the check above would be vacuous for a harmless name)


# ---- in processes of their own ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_make_run_refuses_to_start_on_all_interfaces(tmp_path):
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHARDLAB_NO_WORKER": "1"}
    done = subprocess.run(["make", "-s", "-o", ".venv/.installed", "run", "HOST=0.0.0.0", f"PORT={port}",
                           f"PY={sys.executable}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "refusing to serve the dashboard on 0.0.0.0" in done.stderr, done.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "something listens: the dashboard started anyway"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_trusted_proxy_opt_out_starts_the_dashboard(tmp_path):
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHARDLAB_NO_WORKER": "1", "SHARDLAB_TRUSTED_PROXY": "1",
           "SHARDLAB_DB_URL": f"sqlite:///{tmp_path / 'ui.db'}"}
    proc = subprocess.Popen([sys.executable, "-m", "dashboard.serve", "--host", "0.0.0.0", "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, ok = time.monotonic() + 120, False
        while time.monotonic() < deadline and not ok and proc.poll() is None:
            try:
                ok = urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok"
            except OSError:
                time.sleep(0.5)
        assert ok, proc.stdout.read1().decode() if proc.poll() is not None else "no health answer"
    finally:
        proc.terminate()
        proc.wait(30)
