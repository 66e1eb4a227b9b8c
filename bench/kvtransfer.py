"""KV-transfer speed of each connector vs the raw limit of its transport, one JSON line.

    python bench/kvtransfer.py [--repeats 25] [--sizes 256,1024,4096]
                               [--connectors shared_store,tcp,collective] [--malloc-hugetlb 1]

Payload: the default model's packed KV (SmolLM2-135M-Instruct: 30 layers, 3 KV heads,
head_dim 64, block_size 16, float32 = 46,080 bytes per token), `ceil(tokens / 16)` blocks of
random data, generated inside the sending actor (nothing big crosses the driver).

Processes: sender and receiver are two Ray actors (threaded, max_concurrency=4, torch threads
1, `kv_control` forwarding to the collective connector's `on_control`) on a local
`ray.init(num_cpus=2)` with a 2 GiB object store preallocated (RAY_preallocate_plasma_memory=1).
Each actor hosts one connector of every kind at once; the shared_store one with
`prefault=True` (its page tables for the whole store populated at start: the store is
preallocated, as `kv_transfer.prefault_object_store` expects).

Timing (cross-process, same host): both actors stamp `time.time()` (one system clock for all
processes on a host, microsecond resolution). The sender stamps just before
`connector.send(...)`; the receiver stamps just after `connector.receive(...)` returned the
verified tensor (header checked, checksum computed on the sender and checked on the receiver,
viewed as the KV shape). The transfer time is the difference. For tcp and collective the
receiver's `receive` is already running (waiting on its mailbox: the driver waits for a
"started" event before it lets the sender go), so no Ray scheduling latency is in the number.
For shared_store the receipt (the object ref) must reach the receiver first: the sender actor
calls the receiver actor with it directly (one actor-to-actor call, as a router would), so
that hand-off is included (reported as handoff_ms).

Rounds: per size, 1 warm-up round (it also connects sockets and forms groups), then --repeats
rounds; each round runs one transfer of every connector and every raw baseline, interleaved
in a rotating order, so slow drift on a shared 2-core machine hits all of them alike. Figures
are medians over the rounds. GB/s = payload bytes / 1e9 / seconds. Before the first round
the bench waits (up to 15 s) for Ray's start-up CPU burst to pass.

Breakdown per connector (medians): send_ms (the sender inside `send`: header + checksum +
transport until `send` returns), recv_ms (the receiver inside `receive`; for tcp/collective it
includes waiting for the bytes), tail_ms (from `send` returning or `receive` being called,
whichever is later, to `receive` returning: the receive work not overlapped with the send,
mostly the receiver's checksum; negative when `receive` returned before `send` did).

Raw limits, same bytes, same rounds:
  memcpy     `dst.copy_(src)` of a uint8 tensor into a preallocated buffer, one process
  raw_zmq    one PUSH -> PULL frame, copy=False, between the same two actors; no header, no
             checksum (libzmq allocates the receive buffer, as in the tcp connector)
  raw_gloo   `dist.send` / `dist.recv` of a uint8 tensor into a preallocated buffer, a 2-rank
             gloo group (init_process_group over loopback) between two other, fresh actors
Micro (sender actor, same bytes, after the rounds so the object store is warm): the wire
checksum, zlib's crc32 for comparison,
ray.put of the bytes, a local ray.get, torch.frombuffer, a copy into a freshly allocated
buffer (page faults included) -- the parts the analysis adds up.

Ratios are throughput ratios (= raw time / connector time): tcp / raw_zmq,
shared_store / memcpy, collective / raw_gloo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_peer import Peer, kv_layout, median_ms, one_connector, one_gloo, one_zmq  # noqa: E402
from local_cluster import stdout_for_json_only  # noqa: E402

TARGETS = {"tcp_vs_raw_zmq_min": 0.7, "shared_store_vs_memcpy_min": 0.5}
CONNECTORS = ("shared_store", "tcp", "collective")


def _gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / 1e9 / (ms / 1e3), 3) if ms > 0 else float("inf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(f"[kvtransfer] {msg}", file=sys.stderr, flush=True)


def _settle(max_wait_s: float = 15.0, idle_min: float = 0.85) -> float:
    """Wait until the host's CPUs are mostly idle (Ray's start-up burst is over)."""
    def busy_idle() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]

    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < max_wait_s:
            tot0, idle0 = busy_idle()
            time.sleep(0.5)
            tot1, idle1 = busy_idle()
            if tot1 > tot0 and (idle1 - idle0) / (tot1 - tot0) >= idle_min:
                break
    except OSError:  # not Linux
        time.sleep(2.0)
    return round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--sizes", default="256,1024,4096", help="prompt sizes in tokens")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--malloc-hugetlb", type=int, choices=(0, 1), default=1,
                    help="GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in the actors, as configs/ deploy "
                         "the pools (big receive buffers fault in huge pages); 0: glibc's default")
    ap.add_argument("--object-store-gib", type=float, default=2.0,
                    help="object store size; its memory is touched up front (preallocated) so "
                         "puts do not pay first-touch page faults, as on a long-running server")
    args = ap.parse_args(argv)
    token_sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.malloc_hugetlb:  # read by glibc when each actor's process starts (not by this one)
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    else:
        os.environ.pop("GLIBC_TUNABLES", None)
    names = [c.strip() for c in args.connectors.split(",") if c.strip()]
    for name in names:
        if name not in CONNECTORS:
            ap.error(f"unknown connector {name!r}; choose from {','.join(CONNECTORS)}")
    layout = kv_layout()
    sizes = [(t, math.ceil(t / layout.block_size)) for t in token_sizes]
    nbytes_of = {t: layout.payload_bytes(nb) for t, nb in sizes}

    report: dict[str, Any] = {
        "bench": "kvtransfer",
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    # allocation knobs that change fresh-buffer page-fault costs (the actors')
                    "env": {k: os.environ[k] for k in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")
                            if os.environ.get(k)}},
        "torch": torch.__version__, "ray": ray.__version__,
        "repeats": args.repeats,
        "layout": layout.to_dict(), "bytes_per_token": layout.block_bytes // layout.block_size,
        "timing": "time.time() stamps: sender before send(), receiver after receive() returns; "
                  "1 warm-up round, then median of --repeats interleaved rounds; GB/s = bytes/1e9/s",
        "targets": TARGETS,
    }
    skipped: dict[str, str] = {}
    if "collective" in names:
        try:
            from cluster.kvtransfer.collective import CollectiveConnector  # noqa: F401
        except Exception as exc:  # e.g. a torch without torch.distributed
            skipped["collective"] = f"collective module does not import: {type(exc).__name__}: {exc}"
            names.remove("collective")

    t_start = time.perf_counter()
    os.environ["RAY_preallocate_plasma_memory"] = "1"  # read by the raylet ray.init starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=int(args.object_store_gib * 2**30),
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})  # kv_peer
    actors: list[Any] = []
    try:
        sender, receiver = Peer.remote(names), Peer.remote(names)
        gloo_a, gloo_b = Peer.remote([]), Peer.remote([])  # fresh pair for the raw gloo group
        actors = [sender, receiver, gloo_a, gloo_b]
        pids = ray.get([a.pid.remote() for a in actors])
        assert len(set(pids)) == 4, "every actor must be its own process"
        port = ray.get(receiver.zmq_bind.remote())
        gport = _free_port()
        ray.get([gloo_a.gloo_init.remote(gport, 0), gloo_b.gloo_init.remote(gport, 1)])
        ray.get([sender.make_payload.remote(nb, seed=t) for t, nb in sizes])
        ray.get([g.gloo_alloc.remote(nbytes_of[t], g is gloo_a)
                 for t, _ in sizes for g in (gloo_a, gloo_b)])
        report["settle_s"] = _settle()

        kinds = [*names, "raw_zmq", "raw_gloo"]
        samples: dict[int, dict[str, list[dict[str, float]]]] = {}
        for tokens, nb in sizes:
            samples[tokens] = {k: [] for k in kinds}
            for rnd in range(args.repeats + 1):
                shift = rnd % len(kinds)
                for kind in kinds[shift:] + kinds[:shift]:
                    key = f"{kind}-{tokens}-{rnd}"
                    if kind == "raw_zmq":
                        st = one_zmq(sender, receiver, port, key, nb)
                    elif kind == "raw_gloo":
                        st = one_gloo(gloo_a, gloo_b, key, nbytes_of[tokens])
                    elif kind in skipped:
                        continue
                    else:
                        try:
                            st = one_connector(kind, sender, receiver, key, nb)
                        except Exception as exc:
                            if kind != "collective":
                                raise
                            skipped[kind] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                            _log(skipped[kind])
                            continue
                    if st["nbytes"] != nbytes_of[tokens]:
                        raise RuntimeError(f"{kind} delivered {st['nbytes']} of {nbytes_of[tokens]} bytes")
                    if rnd:  # round 0 is the warm-up
                        samples[tokens][kind].append(st)
            _log(f"{tokens} tokens done")
        # after the rounds: the object store's pages are warm, as in steady state
        micro = {t: ray.get(sender.micro.remote(nb, args.repeats)) for t, nb in sizes}
        ray.get([sender.close.remote(), receiver.close.remote(),
                 gloo_a.gloo_close.remote(), gloo_b.gloo_close.remote()])
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()

    per_size = []
    for tokens, nb in sizes:
        nbytes = nbytes_of[tokens]
        m = micro[tokens]

        def total_ms(sts: list[dict[str, float]]) -> float:
            return median_ms([s["t_end"] - s["t0"] for s in sts])

        raw = {"memcpy": {"ms": m["memcpy_ms"], "gbps": _gbps(nbytes, m["memcpy_ms"])}}
        for kind in ("raw_zmq", "raw_gloo"):
            ms = total_ms(samples[tokens][kind])
            raw[kind] = {"ms": ms, "gbps": _gbps(nbytes, ms)}
        conns: dict[str, dict[str, Any]] = {}
        for name in names:
            sts = samples[tokens].get(name)
            if name in skipped or not sts:
                continue
            ms = total_ms(sts)
            conns[name] = {
                "ms": ms, "gbps": _gbps(nbytes, ms),
                "min_ms": round(min(s["t_end"] - s["t0"] for s in sts) * 1e3, 3),
                "send_ms": median_ms([s["t_send_done"] - s["t0"] for s in sts]),
                "recv_ms": median_ms([s["t_end"] - s["t_recv_start"] for s in sts]),
                "tail_ms": median_ms([s["t_end"] - max(s["t_send_done"], s["t_recv_start"]) for s in sts]),
            }
            if name == "shared_store":
                conns[name]["handoff_ms"] = median_ms([s["t_recv_start"] - s["t_send_done"] for s in sts])
        for name, why in skipped.items():
            conns[name] = {"skipped": why}
        ratios = {}
        for name, base, key in (("tcp", "raw_zmq", "tcp_vs_raw_zmq"),
                                ("shared_store", "memcpy", "shared_store_vs_memcpy"),
                                ("collective", "raw_gloo", "collective_vs_raw_gloo")):
            if "ms" in conns.get(name, {}):
                ratios[key] = round(raw[base]["ms"] / conns[name]["ms"], 3)
        per_size.append({
            "tokens": tokens, "num_blocks": nb, "payload_bytes": nbytes,
            "connectors": conns, "raw": raw, "ratios": ratios,
            "micro": {k: v for k, v in m.items() if k != "memcpy_ms"}
            | {"checksum_gbps": _gbps(nbytes, m["checksum_ms"]), "ray_put_gbps": _gbps(nbytes, m["ray_put_ms"])},
        })
    report["sizes"] = per_size
    for name, why in skipped.items():
        report[name] = {"skipped": why}
    report["meets_targets"] = {}
    for key, target in TARGETS.items():
        got = [s["ratios"].get(key.removesuffix("_min")) for s in per_size]
        report["meets_targets"][key] = None if None in got else all(r >= target for r in got)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


if __name__ == "__main__":
    with stdout_for_json_only():
        report = main()
    print(json.dumps(report))
