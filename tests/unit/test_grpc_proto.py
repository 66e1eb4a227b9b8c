"""The committed Python modules of cluster/router/tandem.proto are what protoc makes of it now: an
edit to the .proto without regenerating (the command is in its header) fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/router/tandem.proto"
GENERATED = ["tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py"]


def test_generated_modules_match_the_proto(tmp_path):
    (tmp_path / "cluster/router").mkdir(parents=True)
    shutil.copy(ROOT / PROTO, tmp_path / PROTO)
    out = str(tmp_path)
    assert protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--pyi_out={out}",
                        f"--grpc_python_out={out}", str(tmp_path / PROTO)]) == 0
    for name in GENERATED:
        fresh = (tmp_path / "cluster/router" / name).read_text()
        assert (ROOT / "cluster/router" / name).read_text() == fresh, f"{name} is stale: regenerate it"


def test_the_service_is_what_servers_and_clients_import():
    from cluster.router import tandem_pb2, tandem_pb2_grpc

    service = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    method = service.methods_by_name["Generate"]
    assert method.full_name == "tandem.v1.Tandem.Generate"
    assert method.server_streaming and not method.client_streaming
    assert "add_TandemServicer_to_server" in dir(tandem_pb2_grpc)  # what grpc_api.SERVICER wraps
