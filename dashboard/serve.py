"""`make run`: start the dashboard, and refuse to expose it beyond this machine by accident.

The dashboard binds 127.0.0.1 by default. Any other address (0.0.0.0, a LAN IP, a host name) starts only
when remote access is set up on purpose, one of:
  1. OIDC login: `.streamlit/secrets.toml` (or ~/.streamlit/secrets.toml) has an `[auth]` section with
     redirect_uri, a strong cookie_secret, client_id, client_secret, server_metadata_url (Streamlit's `st.login`;
     app.py then shows nothing but a log-in button until the user is logged in), and an `[access]` allow-list of
     operators and viewers (dashboard/access_policy.py): login alone would let in anyone the identity provider
     accepts. See README, "Remote access";
  2. a trusted network behind an authenticating reverse proxy: `SHARDLAB_TRUSTED_PROXY=1` (with an [access] list,
     the user the proxy names in its header must be on it).
Otherwise it exits with status 2 and says how to do either, before Streamlit starts.

    python -m dashboard.serve [--host 127.0.0.1] [--port 8501]
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tomllib
from pathlib import Path

from dashboard.access_policy import cookie_secret_problem, parse_policy, read_secrets

REPO = Path(__file__).resolve().parents[1]
TRUSTED_PROXY_ENV = "SHARDLAB_TRUSTED_PROXY"
AUTH_KEYS = ("redirect_uri", "cookie_secret")
PROVIDER_KEYS = ("client_id", "client_secret", "server_metadata_url")


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or "" (all interfaces)


def secrets_paths(cwd: Path = REPO) -> list[Path]:
    """Where Streamlit reads secrets from when started in `cwd` (project file first)."""
    return [cwd / ".streamlit" / "secrets.toml", Path.home() / ".streamlit" / "secrets.toml"]


def auth_problem(paths: list[Path]) -> str | None:
    """None when some secrets file holds a complete `[auth]` section for st.login, else what is missing."""
    problems = []
    for path in paths:
        if not path.exists():
            continue
        try:
            auth = tomllib.loads(path.read_text()).get("auth")
        except (OSError, tomllib.TOMLDecodeError) as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        if not isinstance(auth, dict):
            problems.append(f"{path}: no [auth] section")
            continue
        missing = [k for k in AUTH_KEYS if not auth.get(k)]
        providers = [auth] + [v for v in auth.values() if isinstance(v, dict)]
        if not any(all(p.get(k) for k in PROVIDER_KEYS) for p in providers):
            missing.append("client_id/client_secret/server_metadata_url (in [auth] or an [auth.<provider>])")
        if missing:
            problems.append(f"{path}: [auth] lacks {', '.join(missing)}")
        elif (weak := cookie_secret_problem(auth.get("cookie_secret"))) is not None:
            problems.append(f"{path}: {weak}")
        else:
            return None
    return "; ".join(problems) or "no .streamlit/secrets.toml with an [auth] section"


def access_problem(paths: list[Path], *, required: bool) -> str | None:
    """What is wrong with the [access] allow-list (None when usable; a missing one only when `required`)."""
    secrets, unreadable = read_secrets(paths)
    policy, problems = parse_policy(secrets.get("access"))
    problems = unreadable + problems
    if not problems and required and not policy.configured:
        problems.append("OIDC login alone lets in anyone your identity provider accepts: list who may use the "
                        "dashboard in [access] operators = [...] (may submit, cancel and delete runs) and / or viewers "
                        "= [...] (may look), as e-mail addresses or @domains")
    return "; ".join(problems) or None


def remote_access_problem(host: str, *, env: dict[str, str] | None = None,
                          paths: list[Path] | None = None) -> str | None:
    """Why binding `host` is refused (None when allowed)."""
    env = os.environ if env is None else env
    paths = secrets_paths() if paths is None else paths
    if is_loopback(host):
        return None
    if env.get(TRUSTED_PROXY_ENV) == "1":
        why = access_problem(paths, required=False)
        return None if why is None else f"refusing to serve the dashboard on {host or 'all interfaces'}: {why}"
    why = auth_problem(paths) or access_problem(paths, required=True)
    if why is None:
        return None
    shown = host or "all interfaces"
    return (f"refusing to serve the dashboard on {shown!s}: it would be reachable from other machines without a safe "
            f"login ({why}). Either configure OIDC login for st.login in .streamlit/secrets.toml [auth] with an "
            "[access] allow-list (README: 'Remote access'), or, on a trusted network behind an authenticating proxy, "
            f"set {TRUSTED_PROXY_ENV}=1. Or bind 127.0.0.1 (the default) and use an SSH tunnel.")


def streamlit_argv(host: str, port: int) -> list[str]:
    # No file watcher: over the whole checkout (a .venv included: ~4,700 inotify watches) it overflowed its queue and
    # kept a core busy while idle, skewing the timings ShardLab measures on the same host. Code changes need a restart.
    return [sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--server.fileWatcherType", "none",
            "--server.runOnSave", "false"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start the ShardLab dashboard (refuses remote binds without auth).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8501)
    args = ap.parse_args(argv)
    problem = remote_access_problem(args.host)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cmd = streamlit_argv(args.host, args.port)
    os.chdir(REPO)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
