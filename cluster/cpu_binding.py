"""Which CPU cores a replica's threads run on, when the pools compute on CPU.

    decode replica          claims cores of its own on its node (one per torch thread), and
                            pins every thread of its process to them
    prefill replica, router pin themselves to the node's cores that no decode replica holds,
                            re-read every few seconds as replicas come and go (all of the
                            process's cores when every one is held)
    prefill replica, router also run their threads at nice SHARED_NICE, where the process may
                            raise its priority (root, CAP_SYS_NICE, or an RLIMIT_NICE that
                            allows it); elsewhere at the one Ray gave them (a worker's Python
                            threads: nice 15, RAY_worker_niceness)
    Serve's proxy           raised with the routers on its node (their priority, not their cores)
    decode replica          pinned, runs its threads at nice OWN_NICE (0) where it may, while
                            some core of the node is left to the others

A decode replica's step is what every stream waits on: on its own core it is not preempted by
the HTTP path or a prefill, and its working set stays in that core's caches. On the 2-core host
of docs/performance.md, 16 streams through configs/serve.yaml went from 325 / 346 tok/s with
nothing pinned to 344 / 369 with this binding (the same run, alternating). vLLM-CPU binds its
OpenMP threads to cores for the same reason (VLLM_CPU_OMP_THREADS_BIND).

The cores left to prefill replicas and routers are the ones that idle between prompts, so the
processes nobody pins (Serve's proxy and controller, Ray's GCS, a load generator) settle there:
on the 2-core host, during a ShareGPT replay at 1 req/s, they and the router took ~28% of the
prefill replica's core, and the two 512-token steps of a 1,024-token prompt, 1.5 s of the engine
thread's CPU, took 1.75-2.05 s of wall time (docs/performance.md). At a higher priority than
theirs, a prompt runs first on its core, the router beside it still gets its turn at once, and
the kernel's load balancer, which weighs a core's load by its threads' priorities, moves the
unpinned processes to the decode replica's core, whose steps have room to spare (an ITL of ~30
ms against the 150 ms SLO). With the prefill replica alone raised, the router pinned beside it
waited behind each long prompt (the mixed load's ITL p99 348 ms, against 117 with both raised).
A decode replica at Ray's nice 15 yields its core to any unpinned nice-0 thread the balancer
puts there (the load generator, the proxy's gRPC threads) at a weight of 36 against 1,024, and
the balancer, which sees such a core as nearly idle, puts them there: at nice 0 it shares evenly
and its core counts as loaded. Not -5 like the shared cores': that would push every unpinned
process onto the prefill replica's core. Where decode replicas hold every core (a colocated
app), the routers and Serve's proxy run on theirs at Ray's priority: the decode replicas stay
there too, or the HTTP path would wait behind every step.

A claim is an exclusive fcntl lock on one file per core in a per-user directory under the node's
temp folder: the kernel drops a process's locks when it dies, so a replica that goes away gives
its cores back, and replicas of every app on the node (any Ray cluster of the same user) see
each other's claims. A decode replica that finds no free core runs unpinned. Linux only
(sched_setaffinity); elsewhere, with `cpu_binding: false`, and in a container whose CPU quota is
smaller than the cores it may run on (a pod in a Kubernetes node's shared pool, whose neighbours'
claims it cannot see), nothing is pinned. A pod given whole cores (the static CPU manager
policy) sees only those, and binds within them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

log = logging.getLogger(__name__)

SHARED_NICE = -5  # prefill replicas' and routers' threads: ~3x a nice-0 thread's CPU weight, ~87x nice 15
OWN_NICE = 0  # a pinned decode replica's threads: a nice-0 thread's weight, ~28x nice 15
REFRESH_S = 5.0  # how often a shared binding re-reads which cores the decode replicas hold
_CLAIM_TRIES = 3  # a core's lock may be probed by a shared binding for a moment: try it again


def lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"tandem-cpus-{os.getuid()}"


def _own_dir(directory: Path) -> bool:
    """Create `directory` (0700) if missing; true when it is a real folder of ours that nobody
    else may write (a shared temp folder: another user could have planted it, or links in it)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _open_lock(path: Path) -> IO[str]:
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+")


@dataclass
class CpuBinding:
    """What a process is pinned to: "own" (claimed cores), "shared" (the cores nobody claimed),
    or "none" (unpinned: binding off, not Linux, or no free core to claim)."""

    mode: str
    cores: tuple[int, ...]

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "cores": list(self.cores), "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def supported() -> bool:
    return hasattr(os, "sched_setaffinity") and Path("/proc/self/task").is_dir()


def allowed_cores() -> set[int]:
    """The cores this process may run on (its cgroup's or taskset's)."""
    return set(os.sched_getaffinity(0)) if supported() else set(range(os.cpu_count() or 1))


def each_thread(apply: Callable[[int], Any], pid: int | str = "self") -> dict[int, Any]:
    """`apply(tid)` for every thread of this process (or of `pid`); {tid: its result} for those
    still there (a thread may exit meanwhile)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = apply(int(tid))
        except OSError:  # the thread exited meanwhile
            pass
    return out


def raise_priority(nice: int) -> dict[int, int] | None:
    """Run every thread of this process at `nice` (threads started later inherit their
    starter's); returns each thread's nice value before, for restore_priority, or None when the
    OS does not let this process raise its priority (it is then left as it was)."""
    before = each_thread(lambda tid: os.getpriority(os.PRIO_PROCESS, tid))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # this thread first: refused here, refused for all
    except PermissionError:
        log.info("cpu binding: may not raise this process's priority to nice %d (needs root, CAP_SYS_NICE or "
                 "RLIMIT_NICE); it stays as Ray started it", nice)
        return None
    each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
    return before


def restore_priority(before: dict[int, int], default: int) -> None:
    """Every thread back to its nice value in `before`; those started since to `default`."""
    each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, before.get(tid, default)))


def pin_process(cores: set[int]) -> None:
    """Every thread of this process runs on `cores` from now on (threads it starts later inherit
    their starter's cores, so they stay there too)."""
    each_thread(lambda tid: os.sched_setaffinity(tid, cores))


PROXY_TITLE = b"ray::ProxyActor"  # Ray Serve's HTTP/gRPC proxy, by its process title


def serve_proxies() -> list[int]:
    """The Ray Serve proxies of this process's own Ray node: processes titled as Serve's proxy
    that the same parent (the node's raylet, which starts every worker) started. Another Ray
    cluster's proxies on the same machine are left alone."""
    found, parent = [], os.getppid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:  # "pid (comm) state ppid ...": comm may hold spaces
                if int(f.read().rsplit(b")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if f.read(len(PROXY_TITLE)) == PROXY_TITLE:
                    found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


_held: dict[int, IO[str]] = {}  # this process's claimed cores' lock files, open for its life


class Priority:
    """This process's threads at `nice` while held (`hold(True)`), each back to its own after
    (`hold(False)`). Where the OS refuses (raise_priority), nothing changes and it is not asked
    again; it never lowers a process already at `nice` or above."""

    def __init__(self, nice: int) -> None:
        self.nice, self.own = nice, os.getpriority(os.PRIO_PROCESS, 0)
        self.raised: dict[int, int] | None = None  # while held: each thread's nice before
        self.refused = False

    def hold(self, on: bool) -> None:
        if self.refused:
            return
        if on and self.raised is None and self.own > self.nice:
            self.raised = raise_priority(self.nice)
            self.refused = self.raised is None
        elif not on and self.raised is not None:
            restore_priority(self.raised, self.own)
            self.raised = None


def _every(refresh_s: float, fn: Callable[[], None], name: str) -> None:
    """`fn()` every `refresh_s` from a daemon thread, for the process's life."""
    def run() -> None:
        while True:
            time.sleep(refresh_s)
            try:
                fn()
            except OSError as exc:  # e.g. the lock folder went away: keep the last binding
                log.warning("cpu binding: refresh failed: %s", exc)
    threading.Thread(target=run, name=name, daemon=True).start()


def claim_own(count: int, directory: Path | None = None, nice: int | None = None,
              refresh_s: float = REFRESH_S) -> CpuBinding:
    """Claim `count` free cores, lowest first, and pin this process to them; with `nice`, its
    threads run at that priority while some core of the node is left unclaimed (re-read every
    `refresh_s`: where decode replicas hold every core, the routers and Serve's proxy share
    theirs at Ray's priority, and must not wait behind them). Unpinned, at its own priority,
    when fewer than `count` are free (what was claimed is let go)."""
    if not supported():
        return CpuBinding("none", ())
    directory = directory or lock_dir()
    if not _own_dir(directory):
        log.warning("cpu binding: %s is not a private folder of this user; running unpinned", directory)
        return CpuBinding("none", ())
    node = allowed_cores()  # before pinning
    got: dict[int, IO[str]] = {}
    for attempt in range(_CLAIM_TRIES):
        for core in sorted(allowed_cores() - set(got) - set(_held)):
            if len(got) == count:
                break
            try:
                f = _open_lock(directory / f"core-{core}.lock")
            except OSError:  # not a plain file (a planted link): that core is not ours to claim
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            got[core] = f
        if len(got) == count:
            break
        time.sleep(0.02 * (attempt + 1))
    if len(got) < count:
        for f in got.values():
            f.close()  # closing drops the lock
        log.warning("cpu binding: %d free core(s) wanted, fewer free; running unpinned", count)
        return CpuBinding("none", ())
    _held.update(got)
    pin_process(set(got))
    if nice is not None:
        priority = Priority(nice)

        def watch() -> None:
            priority.hold(bool(node - claimed_cores(node, directory)))
        watch()
        _every(refresh_s, watch, "tandem-cpu-priority")
    return CpuBinding("own", tuple(sorted(got)))


def claimed_cores(cores: set[int], directory: Path | None = None) -> set[int]:
    """Those of `cores` some process holds a claim on now (this one's included)."""
    directory = directory or lock_dir()
    held = set(_held) & cores
    if not _own_dir(directory):  # nobody could claim a core there: none is held
        return held
    for core in cores - held:
        path = directory / f"core-{core}.lock"
        if not path.exists():
            continue
        try:
            f = _open_lock(path)
        except OSError:  # not a plain file: nobody holds it
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                held.add(core)
            # closing drops the probe's lock
    return held


class SharedBinding:
    """Pins this process to the cores no decode replica holds, and keeps doing so every
    `refresh_s` from a daemon thread (a decode replica that starts or dies later moves it).
    With `nice`, its threads run at that priority while a decode replica holds a core and some
    core is left to them (where the OS allows it: raise_priority), at their own otherwise (on a
    GPU node, or when decode replicas hold every core and this process runs on theirs)."""

    def __init__(self, directory: Path | None = None, refresh_s: float = REFRESH_S, nice: int | None = None,
                 proxies: bool = False) -> None:
        """`proxies`: the node's Serve proxies run at its raised priority too (a router's binding:
        the proxy is the other hop of every token's HTTP path)."""
        self.directory = directory or lock_dir()
        self.all = allowed_cores()  # what it may run on before pinning (its own affinity changes)
        self.cores: tuple[int, ...] = tuple(sorted(self.all))  # unpinned: what it starts on
        self.priority = Priority(nice) if nice is not None else None
        self.proxies: dict[int, dict[int, int]] | None = {} if proxies else None  # pid → its threads' nice before
        self.refresh()
        _every(refresh_s, self.refresh, "tandem-cpu-binding")

    def describe(self) -> dict[str, Any]:
        return {"mode": "shared", "cores": list(self.cores), "nice": os.getpriority(os.PRIO_PROCESS, 0)}

    def refresh(self) -> None:
        held = claimed_cores(self.all, self.directory)
        free = (self.all - held) or self.all
        cores = tuple(sorted(free))
        if cores != self.cores:  # threads started since the last pinning inherit it
            pin_process(free)
            self.cores = cores
        if self.priority is not None:  # raised on cores of its own beside a decode replica's; running
            # anywhere, decode replicas' cores too: as Ray started it
            self.priority.hold(bool(held and self.all - held))
        if self.proxies is not None:
            self._raise_proxies()

    def _raise_proxies(self) -> None:
        """The node's Serve proxies at this process's raised priority while it holds one, as they
        were otherwise; where the OS refuses, as they are. Ray starts them at nice 15: behind a
        prompt's prefill at SHARED_NICE they held every stream's tokens for as long as the prompt
        took (the mixed load's ITL p99 255-298 ms, against 80-116 raised; docs/performance.md).
        Not pinned: beside the prefill replica they would double a long prompt's time to its
        first token; the kernel's balancer places them."""
        raised = self.priority is not None and self.priority.raised is not None
        pids = serve_proxies()
        for gone in set(self.proxies) - set(pids):
            del self.proxies[gone]
        for pid in pids:
            try:
                if raised:
                    self.proxies.setdefault(pid, each_thread(lambda tid: os.getpriority(os.PRIO_PROCESS, tid), pid))
                    each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, self.priority.nice), pid)
                elif pid in self.proxies:
                    before = self.proxies.pop(pid)
                    default = max(before.values(), default=0)
                    each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, before.get(tid, default)), pid)
            except OSError:  # gone meanwhile, or not ours to change
                continue


def cpu_quota() -> float | None:
    """The CPUs this process's cgroup may use by quota (cgroup v2, then v1); None: no quota."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def bind(role: str, enabled: bool, threads: int = 1) -> CpuBinding | SharedBinding:
    """A replica's binding: "decode" claims `threads` cores of its own (at OWN_NICE), any other
    role shares the rest, at a raised priority (SHARED_NICE), a router raising the node's Serve
    proxies with it (SharedBinding's `proxies`). Nothing is pinned when not
    `enabled`, not on Linux, or in a container whose CPU quota is less than the cores it sees (a
    Kubernetes pod in the node's shared pool: the other pods run on those cores too, and their
    claims are out of sight)."""
    if not enabled or not supported():
        return CpuBinding("none", ())
    quota = cpu_quota()
    if quota is not None and quota < len(allowed_cores()):
        log.info("cpu binding: a CPU quota of %.2f over %d cores: nothing pinned", quota, len(allowed_cores()))
        return CpuBinding("none", ())
    if role == "decode":
        return claim_own(threads, nice=OWN_NICE)
    return SharedBinding(nice=SHARED_NICE, proxies=role == "router")
