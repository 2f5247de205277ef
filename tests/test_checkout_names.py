"""From the checkout's root, the top-level folders do not shadow installed packages of their names
(pagedq.checkout_names): transformers 5.x imports Hugging Face's ``kernels`` package, which the
checkout's ``kernels/`` folder hid from every test and every ``python -m`` run here."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_at_root(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_transformers_hub_kernels_import_from_the_checkout_root():
    out = _run_at_root("import pagedq, transformers.integrations.hub_kernels as h, kernels;"
                       "print(kernels.__file__)")
    assert not Path(out).resolve().is_relative_to(ROOT)


def test_an_installed_package_wins_over_a_folder_and_the_folder_stays_reachable(tmp_path):
    """With an installed top-level ``kernels`` the import gets it; ``pagedq.kernels`` is still the
    checkout's folder; a name nothing else provides (``worker``) still finds the folder."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'installed'\n")
    out = _run_at_root(
        f"import sys; sys.path.insert(1, {str(tmp_path / 'site')!r}); import pagedq, kernels, worker,"
        " pagedq.kernels.cpu_features as f;"
        " print(kernels.WHO, worker.__file__, f.__file__, sep='|')")
    who, worker_file, features_file = out.split("|")
    assert who == "installed"
    assert Path(worker_file).resolve() == ROOT / "worker" / "__init__.py"
    assert Path(features_file).resolve() == ROOT / "kernels" / "cpu_features.py"
