"""Ray Serve for the cluster tests: started once on the session's local Ray when the first test
that needs it runs (HTTP and gRPC on free loopback ports), every app deleted after each module, and
shut down as soon as the next test does not need it. A Serve start and shutdown costs ~4 s of CPU
on a slow CI host: paid once for the whole directory, not once per module."""

from __future__ import annotations

import pytest

from serving import SERVE_PORTS
from serving import free_port


def _start_serve() -> dict[str, int]:
    from ray import serve

    from cluster.router import grpc_api

    if not SERVE_PORTS:
        http_port, grpc_port = free_port(), free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": [grpc_api.SERVICER]})
        SERVE_PORTS.update(http=http_port, grpc=grpc_port)
    return SERVE_PORTS


def _delete_every_app() -> None:
    from ray import serve

    for name in list(serve.status().applications):
        serve.delete(name)  # (blocks until its replicas are gone)


@pytest.fixture(scope="module")
def serve_ports(ray_local, default_model_path):
    """{'http': port, 'grpc': port} of Ray Serve on the session's local Ray, with no app deployed
    when the module starts; the module's apps are deleted when it ends."""
    yield dict(_start_serve())
    _delete_every_app()


@pytest.fixture(scope="module")
def serve_url(serve_ports):
    """Ray Serve's HTTP address for one test module (see serve_ports)."""
    return f"http://127.0.0.1:{serve_ports['http']}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # (after the test's fixtures are finalized: the module's apps are gone by now)
    if SERVE_PORTS and (nextitem is None or "serve_ports" not in nextitem.fixturenames):
        import ray
        from ray import serve

        if ray.is_initialized():  # (after the session's last test, Ray is already shut down)
            serve.shutdown()
        SERVE_PORTS.clear()
