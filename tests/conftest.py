"""Test-wide setup. Must run before anything imports triton."""

from __future__ import annotations

import os
import shutil

# Without a GPU, run Triton kernels through the interpreter on CPU tensors.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path():
    """The real default model, converted once into the user cache (as `make serve` does)."""
    from cluster.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory, default_model_path):
    """kind → folder of a tiny random model: 'llama', 'qwen2', 'mistral'."""
    from tiny_models import VARIANTS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny_model(kind, root / kind, default_model_path) for kind in VARIANTS}


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session; workers can import the tests' helper modules."""
    import ray

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    repo_dir = os.path.dirname(tests_dir)  # this checkout's cluster/, not whichever one pip installed
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, repo_dir]),
                                          "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}})
    yield ray
    ray.shutdown()
