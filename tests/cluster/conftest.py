from __future__ import annotations

import pytest

from serving import free_port


@pytest.fixture(scope="module")
def serve_url(ray_local, default_model_path):
    """Ray Serve on the session's local Ray, HTTP on a free loopback port, for one test module."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
