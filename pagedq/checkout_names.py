"""Keep the checkout's top-level folders from shadowing installed packages of the same names.

The code lives in the top-level folders ``client/``, ``worker/`` and ``kernels/`` (installed as
``pagedq.client`` ...). Whenever the checkout's root is on ``sys.path`` (pytest's rootdir, ``python
-m`` run from the checkout) those folders are also importable as ``client``, ``worker`` and
``kernels``, and the last is the name of Hugging Face's ``kernels`` package, which transformers
5.x requires and imports (``from kernels import CUDAProperties``): it got this checkout's folder
and every model load failed with an ImportError. Installed pagedq has no such top-level names;
only a checkout does, so only there does :class:`InstalledFirst` step in.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
FOLDER_NAMES = frozenset({"client", "worker", "kernels", "gateway", "bench"})


def _is_checkout_root(entry: str) -> bool:
    """Whether a ``sys.path`` entry ('' is the working directory) is this checkout's root."""
    try:
        return Path(entry or os.getcwd()).resolve() == CHECKOUT_ROOT
    except OSError:
        return False


class InstalledFirst(MetaPathFinder):
    """For a top-level import of one of the folders' names, the same name found anywhere on
    ``sys.path`` except the checkout's root; with none there, the normal search goes on (and
    finds the folder, as before)."""

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if path is not None or fullname not in FOLDER_NAMES:
            return None
        elsewhere = [e for e in sys.path if not _is_checkout_root(e)]
        if len(elsewhere) == len(sys.path):
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, elsewhere, target)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` once, when this is a checkout (``pagedq/kernels``
    is a link to the folder beside it); an installed pagedq needs none."""
    if not (CHECKOUT_ROOT / "pagedq" / "kernels").is_symlink():
        return
    if not any(isinstance(f, InstalledFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, InstalledFirst())
