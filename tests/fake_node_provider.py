"""A recording fake of a cloud for `ray up` / `ray down`: no machines, no SSH, no network.

Ray's cluster launcher accepts `provider: {type: external, module: <path.to.Class>}`. This module
is such a class. Put `tests/` on PYTHONPATH and swap a cluster YAML's provider section for

    provider: {type: external, module: fake_node_provider.FakeNodeProvider,
               record_path: /tmp/x/record.jsonl, state_path: /tmp/x/nodes.json}

and `ray up -y` runs its real code path (config defaults, validation, head launch, file
mounts, setup and start commands) against it:

- `FakeNodeProvider` keeps nodes (config, tags, IPs, state) in memory. With a `state_path`
  it also saves them to JSON after every change and loads them on start, so a later `ray down`
  (another process) sees the head that `ray up` created.
- `get_command_runner` returns a `RecordingCommandRunner`: every command, rsync and init call
  succeeds at once without running anything and is appended to the JSON-lines `record_path`
  (or `$FAKE_PROVIDER_RECORD`). Small synced files are recorded with their content, so a test
  can read the autoscaling config `ray up` ships to the head.
- `read_records(path)` reads the record back as a list of dicts, each with an `event` key:
  create_node, set_node_tags, terminate_node, run, rsync_up, rsync_down, run_init.

Written against Ray 2.60's `ray.autoscaler.node_provider.NodeProvider` and
`ray.autoscaler.command_runner.CommandRunnerInterface`; the `fake_multinode` provider that
ships in that wheel cannot be used (its example.yaml is missing).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.node_provider import NodeProvider

RECORD_ENV = "FAKE_PROVIDER_RECORD"
STATE_ENV = "FAKE_PROVIDER_STATE"
MAX_RECORDED_CONTENT = 1 << 20  # synced files up to 1 MiB are recorded with their text

_record_lock = threading.Lock()


def _append(path: Optional[str], event: str, **fields: Any) -> None:
    if not path:
        return
    line = json.dumps({"event": event, **fields}, sort_keys=True, default=str)
    with _record_lock, open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def read_records(path: os.PathLike | str) -> List[Dict[str, Any]]:
    """Every recorded event, in order (an empty list when nothing was recorded)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line]


class FakeNodeProvider(NodeProvider):
    """Nodes in memory (and optionally in `state_path`); every call is thread-safe."""

    def __init__(self, provider_config: Dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.record_path = provider_config.get("record_path") or os.environ.get(RECORD_ENV)
        self.state_path = provider_config.get("state_path") or os.environ.get(STATE_ENV)
        self._lock = threading.RLock()
        self._nodes: Dict[str, Dict[str, Any]] = {}
        self._next = 1
        if self.state_path and os.path.exists(self.state_path):
            saved = json.loads(Path(self.state_path).read_text(encoding="utf-8"))
            self._nodes, self._next = saved["nodes"], saved["next"]

    # -- bookkeeping ------------------------------------------------------------------------
    def _save(self) -> None:
        if self.state_path:
            tmp = self.state_path + ".tmp"
            Path(tmp).write_text(json.dumps({"nodes": self._nodes, "next": self._next},
                                            sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.state_path)

    def _node(self, node_id: str) -> Dict[str, Any]:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise ValueError(f"unknown node {node_id!r}") from None

    # -- NodeProvider -----------------------------------------------------------------------
    def non_terminated_nodes(self, tag_filters: Dict[str, str]) -> List[str]:
        with self._lock:
            return [nid for nid, n in self._nodes.items()
                    if n["state"] != "terminated"
                    and n["cluster_name"] == self.cluster_name
                    and all(n["tags"].get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id: str) -> bool:
        with self._lock:
            return self._node(node_id)["state"] == "running"

    def is_terminated(self, node_id: str) -> bool:
        with self._lock:
            return self._node(node_id)["state"] == "terminated"

    def node_tags(self, node_id: str) -> Dict[str, str]:
        with self._lock:
            return dict(self._node(node_id)["tags"])

    def internal_ip(self, node_id: str) -> str:
        with self._lock:
            return self._node(node_id)["internal_ip"]

    def external_ip(self, node_id: str) -> str:
        with self._lock:
            return self._node(node_id)["external_ip"]

    def create_node(self, node_config: Dict[str, Any], tags: Dict[str, str],
                    count: int) -> Optional[Dict[str, Any]]:
        created = {}
        with self._lock:
            for _ in range(count):
                i, self._next = self._next, self._next + 1
                node_id = f"fake-{i:04d}"
                self._nodes[node_id] = {
                    "node_config": node_config, "tags": dict(tags), "state": "running",
                    "cluster_name": self.cluster_name,
                    "internal_ip": f"10.0.{i // 250}.{i % 250 + 1}",
                    "external_ip": f"203.0.113.{i % 250 + 1}",  # TEST-NET-3: never routed
                }
                created[node_id] = self._nodes[node_id]
            self._save()
        _append(self.record_path, "create_node", node_ids=sorted(created),
                node_config=node_config, tags=tags, count=count)
        return created

    def set_node_tags(self, node_id: str, tags: Dict[str, str]) -> None:
        with self._lock:
            self._node(node_id)["tags"].update(tags)
            self._save()
        _append(self.record_path, "set_node_tags", node_id=node_id, tags=tags)

    def terminate_node(self, node_id: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            self._node(node_id)["state"] = "terminated"
            self._save()
        _append(self.record_path, "terminate_node", node_id=node_id)
        return None

    def get_command_runner(self, log_prefix: str, node_id: str, auth_config: Dict[str, Any],
                           cluster_name: str, process_runner: Any, use_internal_ip: bool,
                           docker_config: Optional[Dict[str, Any]] = None,
                           ) -> CommandRunnerInterface:
        return RecordingCommandRunner(node_id, self.record_path, use_internal_ip)


class RecordingCommandRunner(CommandRunnerInterface):
    """Records what would run on `node_id` over SSH, and reports success."""

    def __init__(self, node_id: str, record_path: Optional[str], use_internal_ip: bool) -> None:
        self.node_id = node_id
        self.record_path = record_path
        self.use_internal_ip = use_internal_ip

    def run(self, cmd: Optional[str] = None, timeout: int = 120, exit_on_fail: bool = False,
            port_forward=None, with_output: bool = False,
            environment_variables: Optional[Dict[str, object]] = None, run_env: str = "auto",
            ssh_options_override_ssh_key: str = "", shutdown_after_run: bool = False) -> str:
        _append(self.record_path, "run", node_id=self.node_id, cmd=cmd, run_env=run_env,
                environment_variables=environment_variables or {}, with_output=with_output,
                shutdown_after_run=shutdown_after_run)
        return ""

    def _rsync(self, event: str, source: str, target: str,
               options: Optional[Dict[str, Any]]) -> None:
        content = None
        if event == "rsync_up" and os.path.isfile(source):
            if os.path.getsize(source) <= MAX_RECORDED_CONTENT:
                content = Path(source).read_text(encoding="utf-8", errors="replace")
        _append(self.record_path, event, node_id=self.node_id, source=source, target=target,
                options=options or {}, content=content)

    def run_rsync_up(self, source: str, target: str,
                     options: Optional[Dict[str, Any]] = None) -> None:
        self._rsync("rsync_up", source, target, options)

    def run_rsync_down(self, source: str, target: str,
                       options: Optional[Dict[str, Any]] = None) -> None:
        self._rsync("rsync_down", source, target, options)

    def remote_shell_command_str(self) -> str:
        return f"echo 'fake node {self.node_id} has no shell'\n"

    def run_init(self, *, as_head: bool, file_mounts: Dict[str, str],
                 sync_run_yet: bool) -> Optional[bool]:
        _append(self.record_path, "run_init", node_id=self.node_id, as_head=as_head,
                file_mounts=file_mounts, sync_run_yet=sync_run_yet)
        return None
