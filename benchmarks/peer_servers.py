"""The servers `llm_peers.py` compares, each as a real process on a loopback port, one at a
time: the hub (`hub serve`), llama.cpp's `llama-server` and `transformers serve`.

Each is started by a context manager that yields an `Endpoint` once the server answers its
health check, and stops it (SIGINT, then SIGKILL after 30 s) on exit. Every server gets the
same two threads. Also here: finding llama.cpp's pieces (the `llama-server` binary and its
HF-to-GGUF converter, both built from the `llama-cpp-python` sdist's vendored sources, see
benchmarks/README.md) and converting the benchmark model to GGUF F32 once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch.process import free_port, hub_config, hub_process, read_log

# What each request body gains on top of the OpenAI completion fields, given its output
# length: the server's own way to generate exactly that many tokens.
BodyExtra = Callable[[int], dict[str, Any]]

# The converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know. Ours
# splits text with Qwen2's regex (backends/tiny/tokenizer.py), so that is the name to record;
# nothing in the benchmark tokenizes text on llama.cpp's side anyway (prompts are token ids).
_CONVERT = """
import runpy, sys
converter = sys.argv[1]
folder = converter.rsplit("/", 1)[0]
sys.path[:0] = [folder, folder + "/gguf-py"]
import conversion.base, conversion.llama
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name="__main__")
"""


class PeerMissing(RuntimeError):
    """A peer cannot run here (its binary or converter is missing); the message says how to
    get it. The benchmark skips that peer."""


@dataclass(frozen=True)
class Endpoint:
    """A running server: its base URL and process id, the `model` field its requests name,
    whether it takes the prompt as text (else as token ids), and its fixed-length fields."""

    name: str
    base: str
    pid: int
    model: str
    text_prompt: bool
    extra: BodyExtra


def _threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextlib.contextmanager
def hub_server(model_dir: Path, root: Path, threads: int) -> Iterator[Endpoint]:
    """`hub serve` with the benchmark model registered and preloaded."""
    model = {"name": "bench", "kind": "llm", "source": str(model_dir), "preload": True,
             "config": {"kv_cache_bytes": "512MiB", "max_num_seqs": 64,
                        "max_num_batched_tokens": 512}}  # fmt: skip
    path = hub_config(root, [model])
    env = {**_threads_env(threads), "HF_HUB_OFFLINE": "1"}
    with hub_process(path, cwd=root, env=env, timeout=300) as (base, proc):

        def extra(n: int) -> dict[str, Any]:
            return {"ignore_eos": True, "stream_options": {"include_usage": True}}

        yield Endpoint("hub", base, proc.pid, "bench", False, extra)


@contextlib.contextmanager
def _process(
    name: str, argv: list[str], env: dict[str, str], health: str, root: Path, port: int
) -> Iterator[subprocess.Popen[bytes]]:
    log = (root / f"{name}.log").open("w")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{read_log(log.name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after 300 s:\n{read_log(log.name)}")
            time.sleep(0.3)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, root: Path, threads: int, extra_args: Sequence[str] = ()
) -> Iterator[Endpoint]:
    """`llama-server` with continuous batching over 32 slots of 512 tokens each;
    `extra_args` go on its command line (e.g. a draft model)."""
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "--parallel", "32", "--cont-batching", "-c", str(32 * 512),
            "--host", "127.0.0.1", "--port", str(port), *extra_args]  # fmt: skip
    with _process("llama-server", argv, {}, "/health", root, port) as proc:

        def extra(n: int) -> dict[str, Any]:
            return {"n_predict": n, "ignore_eos": True, "stream_options": {"include_usage": True}}

        yield Endpoint("llama.cpp", f"http://127.0.0.1:{port}", proc.pid, "bench", False, extra)


@contextlib.contextmanager
def transformers_server(model_dir: Path, root: Path, threads: int) -> Iterator[Endpoint]:
    """`transformers serve` with its continuous batching, the model preloaded from a local
    folder (offline). Its KV cache is bounded: by default it takes a share of the host's RAM
    (10 GB here)."""
    port = free_port()
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve",
            "--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "1024",
            "--cb-max-batch-tokens", "512", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), str(model_dir)]  # fmt: skip
    env = {**_threads_env(threads), "HF_HUB_OFFLINE": "1"}
    with _process("transformers-serve", argv, env, "/health", root, port) as proc:

        def extra(n: int) -> dict[str, Any]:
            # No `ignore_eos` field: a generation config per request, with no EOS to stop at.
            config = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False,
                      "eos_token_id": None}  # fmt: skip
            return {"generation_config": json.dumps(config)}

        base = f"http://127.0.0.1:{port}"
        yield Endpoint("transformers", base, proc.pid, str(model_dir), True, extra)


def find_llama_server(given: Path | None, cache: Path) -> Path:
    """The `llama-server` binary: `given`, else the cache folder's, else one on PATH."""
    for candidate in (given, cache / "llama-server", shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    where = given or cache / "llama-server"
    raise PeerMissing(f"no llama-server at {where} (nor on PATH): build it from the "
                      "llama-cpp-python sdist as benchmarks/README.md says, or pass "
                      "--llama-server")  # fmt: skip


def ensure_gguf(model_dir: Path, converter: Path | None, cache: Path) -> Path:
    """The benchmark model as GGUF F32 (converted once, beside the model folder)."""
    gguf = model_dir.parent / f"{model_dir.name}-f32.gguf"
    if gguf.is_file() and gguf.stat().st_mtime >= (model_dir / "model.safetensors").stat().st_mtime:
        return gguf
    script = converter or cache / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise PeerMissing(f"no {gguf.name} and no converter at {script}: pass --converter "
                          "(vendor/llama.cpp/convert_hf_to_gguf.py of the llama-cpp-python "
                          "sdist, see benchmarks/README.md)")  # fmt: skip
    argv = [sys.executable, "-c", _CONVERT, str(script.resolve()), str(model_dir),
            "--outtype", "f32", "--outfile", str(gguf)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise PeerMissing(f"converting {model_dir} to GGUF failed:\n{done.stderr[-3000:]}")
    return gguf


def llama_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    return next((line for line in lines if line.startswith("version")), "?")
