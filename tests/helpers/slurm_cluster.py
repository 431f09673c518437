"""A real SLURM cluster for the tests: slurmctld + two slurmd "nodes" (node1, node2) on 127.0.0.1, from
Debian's slurm-wlm 22.05, all state in one temp dir, auth/none (no munge). See /work/shared/MACHINE_FACTS.md.
Needs root (slurmd runs as root). Clients need SLURM_CONF: `env()` gives it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NODES = ("node1", "node2")


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "a SLURM cluster in the tests needs root (slurmd runs as root)"
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel") if shutil.which(b) is None]
    if missing:
        return f"SLURM not installed ({', '.join(missing)} missing; apt-get install slurm-wlm, `make test` does)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, cpus_per_node: int = 2) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="shardlab-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.cpus = cpus_per_node
        self.procs: dict[str, subprocess.Popen] = {}
        ctld, *nodes = _free_ports(1 + len(NODES))
        self.ports = dict(zip(NODES, nodes, strict=False))
        self.ctld_port = ctld

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
                          "State=UNKNOWN"
                          for n, p in self.ports.items())
        self.conf.write_text(f"""ClusterName=shardlabtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=3
MinJobAge=3600
MessageTimeout=10
{nodes}
PartitionName=debug Nodes={','.join(self.ports)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start(self) -> SlurmCluster:
        self.write_conf()
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        for n in NODES:
            self.start_node(n)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.idle_nodes() == set(NODES):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"SLURM nodes never became idle: {self.sinfo()}\n{self.logs()}")

    def start_node(self, name: str) -> None:
        (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
        self._daemon(name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's slurmd (its job processes keep running until SLURM or we end them)."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def sinfo(self) -> str:
        return subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], env=self.env(), capture_output=True,
                              text=True).stdout

    def idle_nodes(self) -> set[str]:
        return {line.split()[0] for line in self.sinfo().splitlines() if line.split()[1:] == ["idle"]}

    def resume_all(self) -> None:
        """Bring nodes a previous test left down/drained back (scontrol update ... state=resume)."""
        for n in NODES:
            if n not in self.procs or self.procs[n].poll() is not None:
                self.start_node(n)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.idle_nodes() != set(NODES):
            subprocess.run(["scontrol", "update", f"nodename={','.join(NODES)}", "state=resume"], env=self.env(),
                           capture_output=True)
            time.sleep(1)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env(), capture_output=True, timeout=30)
        for proc in list(self.procs.values()):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        shutil.rmtree(self.root, ignore_errors=True)
