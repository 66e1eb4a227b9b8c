"""`ray up -y configs/cluster.yaml`, offline: the real Ray CLI against a recording fake cloud.

configs/cluster.yaml stays a real AWS cluster config. The test copies it with only the
`provider` section swapped for `tests/fake_node_provider.py` (Ray's `type: external` hook),
runs the real `ray up -y` and `ray down -y` in subprocesses, and reads back what the fake
recorded: the head node it was asked to launch, every command the launcher would have run
over SSH, and the files it would have synced. No machine, SSH, network or Ray runtime is
involved (each CLI call takes a few seconds; `ray down` waits Ray's fixed 5 s poll once).

What it pins down: the head is the file's head node type; it runs the file's setup commands
in order (one of them installs Tandem with `make install`) and then its head start commands
(`ray stop`, `ray start --head ...`); the autoscaling config shipped to the head carries the
worker types and worker commands as written; `ray down` stops Ray and terminates the head.
Expected commands come from the YAML itself, not from strings copied into this file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fake_node_provider import read_records
from ray.autoscaler.tags import (NODE_KIND_HEAD, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND,
                                 TAG_RAY_NODE_NAME, TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "configs" / "cluster.yaml"
TESTS_DIR = ROOT / "tests"
RAY_CLI = Path(sys.executable).parent / "ray"
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` puts the head's autoscaler config
# Ray prefixes head start commands with `export RAY_...=...; ` (autoscaler v2 switches).
RAY_ENV_PREFIX = re.compile(r"^(?:export [A-Za-z_][A-Za-z0-9_]*=[^;]*; )*")


def load_cluster_yaml() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def ray_cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(RAY_CLI), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"ray {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


class FakeCluster:
    """The copied config, the fake's record/state files, and the events of each CLI call."""

    def __init__(self, tmp: Path):
        self.config = load_cluster_yaml()
        self.record = tmp / "record.jsonl"
        self.state = tmp / "nodes.json"
        fake = dict(self.config)
        fake["provider"] = {"type": "external", "module": "fake_node_provider.FakeNodeProvider",
                            "record_path": str(self.record), "state_path": str(self.state)}
        self.path = tmp / "cluster.yaml"
        self.path.write_text(yaml.safe_dump(fake, sort_keys=False))
        for d in ("home", "tmp"):  # Ray's config cache and bootstrap file go to TMPDIR
            (tmp / d).mkdir()
        self.env = {**os.environ, "HOME": str(tmp / "home"), "TMPDIR": str(tmp / "tmp"),
                    "PYTHONPATH": os.pathsep.join(
                        [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.up_events: list[dict] = []
        self.down_events: list[dict] = []

    def up(self) -> None:
        ray_cli("up", "-y", str(self.path), env=self.env)
        self.up_events = read_records(self.record)

    def down(self) -> None:
        ray_cli("down", "-y", str(self.path), env=self.env)
        self.down_events = read_records(self.record)[len(self.up_events):]

    @property
    def head_id(self) -> str:
        (created,) = [e for e in self.up_events if e["event"] == "create_node"]
        (node_id,) = created["node_ids"]
        return node_id


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fake = FakeCluster(tmp_path_factory.mktemp("ray-up"))
    fake.up()
    return fake


@pytest.fixture(scope="module")
def torn_down(cluster):
    cluster.down()
    return cluster


def runs_on(events: list[dict], node_id: str) -> list[dict]:
    return [e for e in events if e["event"] == "run" and e["node_id"] == node_id]


def declared_commands(events: list[dict], node_id: str) -> list[str]:
    """The commands a node ran, minus Ray's own probes (`uptime`, `mkdir -p` before a sync)
    and minus the env exports Ray puts in front of start commands."""
    return [RAY_ENV_PREFIX.sub("", e["cmd"]) for e in runs_on(events, node_id)
            if e["cmd"] != "uptime" and not e["cmd"].startswith("mkdir -p ")]


def test_cluster_yaml_stays_a_real_aws_config():
    config = load_cluster_yaml()
    assert config["provider"]["type"] == "aws"
    assert config["provider"].get("region")
    for node_type in config["available_node_types"].values():
        assert {"InstanceType", "ImageId"} <= set(node_type["node_config"])


def test_ray_up_launches_one_head_of_the_head_node_type(cluster):
    head_type = cluster.config["head_node_type"]
    (created,) = [e for e in cluster.up_events if e["event"] == "create_node"]
    assert created["count"] == 1
    head_config = cluster.config["available_node_types"][head_type]["node_config"]
    assert created["node_config"] == head_config
    assert created["tags"][TAG_RAY_NODE_KIND] == NODE_KIND_HEAD
    assert created["tags"][TAG_RAY_USER_NODE_TYPE] == head_type
    assert created["tags"][TAG_RAY_NODE_NAME] == f"ray-{cluster.config['cluster_name']}-head"
    # `ray up` starts only the head; the head's autoscaler launches the workers.
    assert not [e for e in cluster.up_events if e["event"] == "terminate_node"]
    statuses = [e["tags"][TAG_RAY_NODE_STATUS] for e in cluster.up_events
                if e["event"] == "set_node_tags" and TAG_RAY_NODE_STATUS in e["tags"]]
    assert statuses[-1] == STATUS_UP_TO_DATE


def test_head_runs_the_setup_commands_then_starts_ray(cluster):
    config = cluster.config
    setup = (config["initialization_commands"] + config["setup_commands"]
             + config["head_setup_commands"])
    start = config["head_start_ray_commands"]
    assert declared_commands(cluster.up_events, cluster.head_id) == setup + start

    install = [i for i, cmd in enumerate(setup) if "make install" in cmd]
    ray_start = [i for i, cmd in enumerate(start) if "ray start --head" in cmd]
    assert install and ray_start, "the head must install Tandem and start a Ray head"
    assert re.search(r"^install:", (ROOT / "Makefile").read_text(), re.M), \
        "setup runs `make install`, so the Makefile needs an install target"
    # Only the head ran anything: `ray up` touches no worker.
    assert {e["node_id"] for e in cluster.up_events if e["event"] == "run"} == {cluster.head_id}


def test_setup_commands_can_run_again(tmp_path):
    """What a node's shell does with the setup commands, twice (a second `ray up`): sudo, git and
    make are stand-ins that log their arguments (git clone makes the folder), so the file's own
    shell logic runs for real in a scratch home. The first run clones, the second pulls, and
    ~/.bashrc gets the venv line once."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for name, extra in {"sudo": "", "make": "",
                        "git": 'if [ "$1" = clone ]; then mkdir -p "$3"; fi'}.items():
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{extra}\n')
        (bin_dir / name).chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    commands = yaml.safe_load(CLUSTER_YAML.read_text())["setup_commands"]
    for _ in range(2):
        for cmd in commands:
            subprocess.run(["bash", "-c", cmd], cwd=home, env=env, check=True)
    calls = log.read_text().splitlines()
    gits = [c for c in calls if c.startswith("git ")]
    assert len(gits) == 2 and gits[0].startswith("git clone ") and gits[1] == "git -C tandem pull --ff-only"
    assert calls.count("make install") == 2
    assert (home / ".bashrc").read_text().splitlines() == ["source ~/tandem/.venv/bin/activate"]


def test_head_gets_the_autoscaling_config_the_workers_need(cluster):
    config = cluster.config
    synced = [e for e in cluster.up_events
              if e["event"] == "rsync_up" and e["target"] == BOOTSTRAP_CONFIG]
    assert len(synced) == 1 and synced[0]["node_id"] == cluster.head_id
    head_start = " && ".join(config["head_start_ray_commands"])
    assert f"--autoscaling-config={BOOTSTRAP_CONFIG}" in head_start
    # The config reaches the head before `ray start` reads it.
    order = [e for e in cluster.up_events if e["event"] in ("rsync_up", "run")]
    first_start = next(i for i, e in enumerate(order)
                       if e["event"] == "run" and "ray start" in e["cmd"])
    assert order.index(synced[0]) < first_start

    remote = json.loads(synced[0]["content"])
    assert remote["cluster_name"] == config["cluster_name"]
    assert remote["head_node_type"] == config["head_node_type"]
    assert remote["available_node_types"] == config["available_node_types"]
    worker_setup = config["setup_commands"] + config["worker_setup_commands"]
    assert remote["worker_setup_commands"] == worker_setup
    assert remote["worker_start_ray_commands"] == config["worker_start_ray_commands"]
    assert any("make install" in cmd for cmd in remote["worker_setup_commands"])
    assert any("ray start --address=" in cmd for cmd in remote["worker_start_ray_commands"])


def test_ray_down_stops_ray_and_terminates_the_head(torn_down):
    head = torn_down.head_id
    events = torn_down.down_events
    assert not [e for e in events if e["event"] == "create_node"]
    assert [e["cmd"] for e in runs_on(events, head)] == ["ray stop"]
    assert [e["node_id"] for e in events if e["event"] == "terminate_node"] == [head]
    state = json.loads(torn_down.state.read_text())
    assert {nid: n["state"] for nid, n in state["nodes"].items()} == {head: "terminated"}
