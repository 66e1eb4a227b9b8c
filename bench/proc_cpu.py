"""What each process of a local Ray spends, read from /proc (Linux): CPU seconds per process and
per thread, each process's role in the Serve app, and the whole machine's busy time. Used by
bench/dataplane.py."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _fields(stat: str) -> list[str]:
    """A /proc/.../stat line's fields after the command name (which may hold spaces)."""
    return Path(stat).read_text().rsplit(")", 1)[1].split()


def _seconds(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in seconds)"""
    try:
        fields = _fields(f"/proc/{pid}/stat")
    except OSError:
        return None
    return int(fields[1]), _seconds(fields)


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    for key, role in (("ProxyActor", "proxy"), (":Router", "router"), (":DecodePool", "decode"),
                      (":PrefillPool", "prefill"), ("ServeController", "controller")):
        if key in cmd:
            return role
    return "ray_other"


def thread_seconds(pid: int) -> dict[str, float]:
    """A process's CPU seconds by thread name (/proc/PID/task/*/comm, 15 characters; threads of
    one name summed): the decode replica's engine thread against its event loop and Ray's."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            seconds = _seconds(_fields(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def ray_processes() -> dict[int, str]:
    """pid → role for every process of this session's Ray: its daemons and their descendants."""
    import ray

    node = ray._private.worker._global_node
    roots = {info.process.pid for infos in node.all_processes.values() for info in infos if info.process}
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parent[int(entry)] = st[0]
    ours = set(roots)
    changed = True
    while changed:
        new = {p for p, pp in parent.items() if pp in ours and p not in ours}
        ours |= new
        changed = bool(new)
    return {p: _role(p) for p in ours}


def cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    return {p: st[1] for p in pids if (st := _stat(p)) is not None}


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process)."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK
