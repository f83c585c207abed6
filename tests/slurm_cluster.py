"""A real single-machine Slurm cluster for tests: slurmctld + one slurmd per virtual node, started by hand.

Facts this relies on (measured on Debian's packages): Debian's Slurm 22.05 runs without
systemd; ``AuthType=auth/none`` + ``CredType=cred/none`` need no munge; several slurmd on one host
work with ``NodeName=a,b NodeHostname=localhost Port=...`` and ``slurmd -N name``; the node names must
resolve (an /etc/hosts line, removed again on stop); ``MinJobAge=4`` makes ``sbatch --wait`` return
promptly. Ports and node names are chosen per cluster, so two test runs on one machine do not collide.

    with SlurmCluster(nodes=2) as c:
        res = c.sbatch(["-N", "2", "script.sbatch"], cwd=repo)

Everything the cluster starts is stopped by pid (``scontrol shutdown``, then SIGTERM/SIGKILL to the pids
it recorded); nothing else is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun")
HOSTS = "/etc/hosts"


def missing_reason() -> str | None:
    """Why a local cluster cannot be started here (None when it can)."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}); install it with: apt-get install -y "
            f"--no-install-recommends slurmctld slurmd slurm-client munge (as .ci/run does)"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (SlurmUser=root and an /etc/hosts entry for the virtual nodes)"
    if not os.access(HOSTS, os.W_OK):
        return f"{HOSTS} is not writable (the virtual node names must resolve)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def clean_env(extra: dict | None = None) -> dict:
    """The caller's environment without ``SLURM_*`` (srun/sbatch read those as options) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra or {})
    return env


class SlurmCluster:
    """slurmctld + ``nodes`` slurmd daemons with ``cpus`` CPUs each, all state under a temp folder."""

    def __init__(self, nodes: int = 2, cpus: int = 1, memory_mb: int = 2000):
        self.nodes, self.cpus, self.memory_mb = nodes, cpus, memory_mb
        self.dir = Path(tempfile.mkdtemp(prefix="mg-slurm-"))
        tag = f"{os.getpid() % 100000:05d}"
        self.node_names = [f"mgn{tag}x{i}" for i in range(1, nodes + 1)]
        self.hosts_line = f"127.0.0.1 {' '.join(self.node_names)}  # megatron-geo test {tag}\n"
        self.conf = self.dir / "slurm.conf"
        self.pids: dict[str, int] = {}
        self._hosts_added = False

    # -- configuration -------------------------------------------------------------------------------------------
    def write_conf(self) -> None:
        ctl_port, *node_ports = _free_ports(1 + self.nodes)
        d = self.dir
        for sub in ("state", "spool", "log", "run"):
            (d / sub).mkdir(exist_ok=True)
        lines = [
            "ClusterName=mgtest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "MinJobAge=4",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
        ]
        for name, port in zip(self.node_names, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        for n in self.node_names:
            (d / "spool" / n).mkdir(exist_ok=True)

    def env(self, extra: dict | None = None) -> dict:
        return clean_env({"SLURM_CONF": str(self.conf), **(extra or {})})

    # -- /etc/hosts ----------------------------------------------------------------------------------------------
    def _add_hosts(self) -> None:
        with open(HOSTS, "a") as f:
            f.write(self.hosts_line)
        self._hosts_added = True

    def _remove_hosts(self) -> None:
        if not self._hosts_added:
            return
        text = Path(HOSTS).read_text()
        lines = text.splitlines(keepends=True)
        kept = [ln for ln in lines if ln != self.hosts_line]
        with open(HOSTS, "w") as f:  # in place: /etc/hosts may be a bind mount that cannot be replaced
            f.write("".join(kept))
        self._hosts_added = False

    # -- daemons -------------------------------------------------------------------------------------------------
    def _run(self, args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def _read_pid(self, name: str, timeout: float = 10) -> int:
        path = self.dir / "run" / name
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                return int(path.read_text().strip())
            except (OSError, ValueError):
                time.sleep(0.1)
        raise RuntimeError(f"{path} did not appear; see the logs in {self.dir / 'log'}")

    def start(self, timeout: float = 30) -> SlurmCluster:
        """Write slurm.conf, add the host names, start slurmctld and the slurmd daemons, wait until idle."""
        self.write_conf()
        self._add_hosts()
        r = self._run([_which("slurmctld"), "-c"])
        if r.returncode:
            raise RuntimeError(f"slurmctld failed to start: {r.stderr}")
        self.pids["slurmctld"] = self._read_pid("slurmctld.pid")
        for n in self.node_names:
            r = self._run([_which("slurmd"), "-N", n])
            if r.returncode:
                raise RuntimeError(f"slurmd -N {n} failed to start: {r.stderr}")
            self.pids[n] = self._read_pid(f"slurmd-{n}.pid")
        end = time.monotonic() + timeout
        states = ""
        while time.monotonic() < end:
            r = self._run([_which("sinfo"), "-h", "-N", "-o", "%N %t"])
            states = r.stdout.strip()
            rows = dict(ln.split() for ln in states.splitlines() if len(ln.split()) == 2)
            if len(rows) == self.nodes and all(s == "idle" for s in rows.values()):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout} s: {states!r}; logs in {self.dir / 'log'}")

    def stop(self) -> None:
        """``scontrol shutdown``, then end any daemon still alive by its recorded pid; drop the hosts line."""
        try:
            if self.pids:
                try:
                    self._run([_which("scontrol"), "shutdown"], timeout=15)
                except (subprocess.SubprocessError, OSError):
                    pass
                end = time.monotonic() + 10
                while time.monotonic() < end and any(_alive(p) for p in self.pids.values()):
                    time.sleep(0.2)
                for pid in self.pids.values():
                    if _alive(pid):
                        os.kill(pid, signal.SIGTERM)
                end = time.monotonic() + 5
                while time.monotonic() < end and any(_alive(p) for p in self.pids.values()):
                    time.sleep(0.2)
                for pid in self.pids.values():
                    if _alive(pid):
                        os.kill(pid, signal.SIGKILL)
                self.pids.clear()
            self._kill_strays()
        finally:
            self._remove_hosts()

    def _stray_pids(self) -> list[int]:
        """Processes this cluster started that outlived its daemons (slurmstepd of a killed job, its tasks):
        found by ``SLURM_CONF=<this cluster's slurm.conf>`` in their environment, which only they carry."""
        marker = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                continue
        return out

    def _kill_strays(self) -> None:
        pids = [p for p in self._stray_pids() if _alive(p)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 3
            while time.monotonic() < end and any(_alive(p) for p in pids):
                time.sleep(0.1)
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- jobs ----------------------------------------------------------------------------------------------------
    def sbatch(
        self, args: list[str], cwd: str, env: dict | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """``sbatch --wait ARGS`` from ``cwd``; its return code is the job's exit code."""
        return subprocess.run(
            [_which("sbatch"), "--wait", *args],
            cwd=cwd,
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def logs(self) -> str:
        """The daemons' log files (for failure messages)."""
        out = []
        for p in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text()[-3000:]}")
        return "\n".join(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours would look alive; the daemons fork away from us, so this is their real state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
