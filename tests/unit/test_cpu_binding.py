"""CPU binding (cluster/cpu_binding.py), across real processes: a decode replica claims a core of
its own and every thread of it runs there, a second one takes the next core, the others run on
what is left, and a replica that dies gives its core back; a prefill replica's threads run at a
raised priority where the OS allows it, a decode replica's at nice 0 (the children start at
nice 10, as Ray starts a worker's Python threads at 15)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cpu_binding

CHILD = """
import json, os, sys, threading
from pathlib import Path
from cluster import cpu_binding

role, directory = sys.argv[1], Path(sys.argv[2])
early = threading.Thread(target=threading.Event().wait, daemon=True)  # started before binding
early.start()
if role == "own":
    binding = cpu_binding.claim_own(1, directory, nice=cpu_binding.OWN_NICE, refresh_s=0.1)
else:  # "shared", or "router": the node's Serve proxies raised with it
    binding = cpu_binding.SharedBinding(directory, refresh_s=0.1, nice=cpu_binding.SHARED_NICE,
                                        proxies=role == "router")
for line in sys.stdin:  # each line asks for a report
    print(json.dumps({**binding.describe(), "process": sorted(os.sched_getaffinity(0)),
                      "early_thread": sorted(os.sched_getaffinity(early.native_id)),
                      "early_nice": os.getpriority(os.PRIO_PROCESS, early.native_id)}), flush=True)
"""


START_NICE = 10


class Child:
    def __init__(self, role: str, directory: Path) -> None:
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, role, str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(repo)},
                                     preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, START_NICE))

    def report(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def wait_report(child: Child, want: list[int], timeout_s: float = 5.0, nice: int | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        report = child.report()
        if (report["cores"] == want and nice in (None, report["nice"])) or time.monotonic() > deadline:
            return report
        time.sleep(0.05)


def test_decode_replicas_own_cores_the_rest_share_what_is_left_and_a_dead_ones_come_back(tmp_path):
    cores = sorted(cpu_binding.allowed_cores())
    first = Child("own", tmp_path)
    children = [first]
    try:
        a = first.report()
        assert a["mode"] == "own" and a["cores"] == cores[:1]
        assert a["process"] == a["early_thread"] == cores[:1]  # every thread, those started before too
        # raised while some core is left to the others (where the OS allows it), every thread
        own = cpu_binding.OWN_NICE if may_raise() and len(cores) > 1 else START_NICE
        assert a["nice"] == a["early_nice"] == own

        shared = Child("shared", tmp_path)
        children.append(shared)
        left = cores[1:] or cores  # nothing left: the shared ones run anywhere
        s = wait_report(shared, left)
        assert s["mode"] == "shared" and s["cores"] == left and s["process"] == s["early_thread"] == left
        # beside a decode replica, on cores of their own: raised where allowed, every thread
        raised = cpu_binding.SHARED_NICE if may_raise() and len(cores) > 1 else START_NICE
        assert s["nice"] == s["early_nice"] == raised

        if len(cores) > 1:  # a second decode replica takes the next core, not the first one's
            second = Child("own", tmp_path)
            children.append(second)
            assert second.report()["cores"] == cores[1:2]
            s = wait_report(shared, cores, nice=START_NICE)  # every core held: run anywhere, decode's cores too,
            assert s["cores"] == cores and s["nice"] == s["early_nice"] == START_NICE  # as it started
            if len(cores) == 2:  # and the decode replicas, whose cores they share, too
                a = wait_report(first, cores[:1], nice=START_NICE)
                assert a["nice"] == a["early_nice"] == START_NICE
            second.stop()
            s = wait_report(shared, left, nice=raised)  # its cores and its nice are set one after the other
            assert s["nice"] == s["early_nice"] == raised
            a = wait_report(first, cores[:1], nice=own)
            assert a["nice"] == a["early_nice"] == own

        first.stop()  # its lock goes with it
        s = wait_report(shared, cores, nice=START_NICE)
        assert s["cores"] == s["process"] == cores and s["nice"] == START_NICE  # no decode replica: as it started
        third = Child("own", tmp_path)
        children.append(third)
        assert third.report()["cores"] == cores[:1]  # the dead replica's core is free to claim again
    finally:
        for child in children:
            child.stop()


def test_no_free_core_leaves_a_decode_replica_unpinned(tmp_path):
    cores = sorted(cpu_binding.allowed_cores())
    owners = [Child("own", tmp_path) for _ in cores]
    try:
        assert sorted(c for o in owners for c in o.report()["cores"]) == cores
        late = Child("own", tmp_path)
        owners.append(late)
        report = late.report()
        assert report["mode"] == "none" and report["cores"] == [] and report["process"] == cores
        assert report["nice"] == START_NICE  # not pinned: not raised either
    finally:
        for owner in owners:
            owner.stop()


PRIORITY_CHILD = """
import json, os, sys, threading
from cluster import cpu_binding

early = threading.Thread(target=threading.Event().wait, daemon=True)  # started before
early.start()
got = cpu_binding.raise_priority(int(sys.argv[1])) is not None
late = threading.Thread(target=threading.Event().wait, daemon=True)  # started after: inherits it
late.start()
nice = {t: os.getpriority(os.PRIO_PROCESS, t) for t in (threading.get_native_id(), early.native_id, late.native_id)}
print(json.dumps({"got": got, "threads": sorted(nice.values())}))
"""


def priority_child(nice: int, *, preexec=None) -> dict:
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", PRIORITY_CHILD, str(nice)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(repo)}, preexec_fn=preexec, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_router_raises_the_nodes_serve_proxy_with_it_and_lets_it_go_after(tmp_path):
    """Ray starts Serve's proxy at its workers' low priority; a router running raised beside a
    decode replica raises the proxy (every thread) to its own priority, and puts it back when
    it runs as Ray started it (no decode replica holds a core). Another process, and a proxy
    another parent started (another Ray node on the machine), are left alone."""
    cores = sorted(cpu_binding.allowed_cores())
    if len(cores) < 2 or not may_raise():
        pytest.skip("needs 2 cores and the right to raise a priority (root or CAP_SYS_NICE)")
    start = lambda title: subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 120'],  # noqa: E731
                                           preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, START_NICE))
    proxy, other = start("ray::ProxyActor"), start("ray::SomethingElse")
    # another Ray node's proxy on the same machine: started by another parent than the router's
    elsewhere = subprocess.Popen(["bash", "-c", '(exec -a "ray::ProxyActor" sleep 120) & echo $!; wait'],
                                 stdout=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, START_NICE))
    foreign = int(elsewhere.stdout.readline())
    decode = Child("own", tmp_path)
    router = None
    try:
        decode.report()
        router = Child("router", tmp_path)
        wait_report(router, cores[1:], nice=cpu_binding.SHARED_NICE)
        nice = lambda pid: os.getpriority(os.PRIO_PROCESS, pid)  # noqa: E731
        deadline = time.monotonic() + 5
        while nice(proxy.pid) != cpu_binding.SHARED_NICE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nice(proxy.pid) == cpu_binding.SHARED_NICE and nice(other.pid) == START_NICE
        assert nice(foreign) == START_NICE
        decode.stop()  # no decode replica: the router runs as it started, and the proxy too
        wait_report(router, cores, nice=START_NICE)
        deadline = time.monotonic() + 5
        while nice(proxy.pid) != START_NICE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nice(proxy.pid) == START_NICE
    finally:
        for child in (decode, router):
            if child is not None:
                child.stop()
        with contextlib.suppress(ProcessLookupError):  # the other parent's proxy (bash's child)
            os.kill(foreign, signal.SIGKILL)
        for p in (proxy, other, elsewhere):
            p.kill()
            p.wait(timeout=10)


def may_raise() -> bool:
    """Whether this process (and so a child) may raise its priority to SHARED_NICE."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - cpu_binding.SHARED_NICE


def test_raising_a_priority_takes_every_thread_or_leaves_them_all_when_refused():
    """Raising a priority needs root, CAP_SYS_NICE or an RLIMIT_NICE that allows it; lowering one
    never does. A process refused (not root, RLIMIT_NICE 0: nice values below its own are out of
    reach) keeps the nice it had, in every thread."""
    import resource
    if may_raise():
        assert priority_child(cpu_binding.SHARED_NICE) == {"got": True, "threads": [cpu_binding.SHARED_NICE] * 3}
    assert priority_child(7) == {"got": True, "threads": [7, 7, 7]}  # lowering: always allowed

    def unprivileged() -> None:  # what a replica without CAP_SYS_NICE meets
        os.nice(2)
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        if os.geteuid() == 0:  # root keeps what it may do across exec, but what its bounding set holds
            import ctypes

            PR_CAPBSET_DROP, CAP_SYS_NICE = 24, 23
            if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_SYS_NICE)")

    assert priority_child(cpu_binding.SHARED_NICE, preexec=unprivileged) == {"got": False, "threads": [2, 2, 2]}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cpu_binding_arg_must_be_a_bool(value):
    from cluster.app_config import AppConfig

    with pytest.raises(ValueError, match="cpu_binding must be true or false"):
        AppConfig.from_args({"cpu_binding": value})


def test_nothing_is_pinned_when_off_or_under_a_cpu_quota_smaller_than_the_cores_seen(monkeypatch):
    before = os.sched_getaffinity(0)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    unbound = {"mode": "none", "cores": [], "nice": nice}
    assert cpu_binding.bind("decode", enabled=False).describe() == unbound
    assert cpu_binding.bind("prefill", enabled=False).describe() == unbound
    monkeypatch.setattr(cpu_binding, "cpu_quota", lambda: len(before) - 0.5)  # a pod in a shared pool
    assert cpu_binding.bind("decode", enabled=True).describe() == unbound
    assert cpu_binding.bind("router", enabled=True).describe() == unbound
    assert cpu_binding.bind("prefill", enabled=True).describe() == unbound
    assert os.sched_getaffinity(0) == before and os.getpriority(os.PRIO_PROCESS, 0) == nice


def test_a_lock_folder_others_may_write_is_not_used(tmp_path):
    """The folder lives in the shared temp folder: one another user planted (or could fill with
    links to our files) leaves the replica unpinned rather than writing through it."""
    planted = tmp_path / "planted"
    planted.mkdir()
    planted.chmod(0o777)
    before = os.sched_getaffinity(0)
    assert cpu_binding.claim_own(1, planted).describe() == {"mode": "none", "cores": [], "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    assert os.sched_getaffinity(0) == before and not list(planted.iterdir())
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cores = sorted(before)
    (private / f"core-{cores[0]}.lock").symlink_to(victim)
    child = Child("own", private)
    try:  # a link where a lock file should be is never opened: that core is skipped
        assert child.report()["cores"] == cores[1:2]
    finally:
        child.stop()
    assert victim.read_text() == "keep me"
