"""Import rules between the layers (docs/architecture.md), checked statically and at run time."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "triage": (
        "triton",
        "trl",
        "transformers",
        "accelerate",
        "datasets",
        "triage.kernels",
        "triage.trainers",
        "triage.experiments",
    ),
    "kernels": ("trl", "triage.trainers", "triage.experiments"),
    "trainers": ("triage.experiments",),
    # the samplers (and their KV-cache numerics) sit below the diagnostics, which run them
    "trainers/sampling": ("triage.trainers.diagnostics",),
}
#: The installed package of each top-level folder (setup.py ``package_dir``).
PACKAGES = {"triage": "triage", "kernels": "triage.kernels", "trainers": "triage.trainers"}


def _package(path: Path) -> str:
    """The dotted package a source file belongs to (``trainers/sampling/hf.py`` -> triage.trainers.sampling)."""
    top, *rest = path.relative_to(ROOT).parent.parts
    return ".".join((PACKAGES[top], *rest))


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved (``from .x import y`` in
    ``triage.trainers.sampling`` -> ``triage.trainers.sampling.x`` and ``...x.y``, as ``y`` may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = _package(path).split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_upward_imports(folder):
    """Static imports (top-level and inside functions, absolute and relative) follow the layer rules."""
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[folder]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_no_top_level_kernels_package():
    import triage.kernels

    assert triage.kernels.__name__ == "triage.kernels"
    assert "site-packages/kernels" not in str(triage.kernels.__file__)


@pytest.mark.parametrize("real", ["installed", "absent"])
def test_checkout_root_never_shadows_huggingface_kernels(real):
    """Run from a checkout's root (``python -m ...`` puts it on sys.path), ``import kernels`` — which
    transformers does — must get Hugging Face's ``kernels`` where it is installed, and must not fail where it
    is not (transformers then reads its missing distribution and goes on without it). "absent" hides the real
    package from the path finder."""
    code = (
        "import sys, os, importlib.machinery\n"
        "path = [p for p in sys.path if p and os.path.abspath(p) != os.getcwd()]\n"
        "spec = importlib.machinery.PathFinder.find_spec('kernels', path)\n"
        "real = spec and os.path.dirname(os.path.dirname(spec.origin))\n"
        "if not real or os.path.samefile(real, os.getcwd()):\n    print('none'); sys.exit()\n"
        f"if {real == 'absent'}:\n"  # the finder no longer sees it outside the checkout
        "    find = importlib.machinery.PathFinder.find_spec\n"
        "    def hide(name, path=None, target=None):\n"
        "        outside = path is not None and os.getcwd() not in map(os.path.abspath, path)\n"
        "        return None if name == 'kernels' and outside else find(name, path, target)\n"
        "    importlib.machinery.PathFinder.find_spec = hide\n"
        "import kernels, triage.kernels\n"
        "print(kernels.__file__, hasattr(kernels, 'NVFP4Linear'), triage.kernels.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    if out == "none":
        pytest.skip("Hugging Face's kernels is not installed here")
    where, ours, name = out.split()
    assert name == "triage.kernels", out
    if real == "installed":
        assert not Path(where).resolve().is_relative_to(ROOT) and ours == "False", out
    else:
        assert Path(where).resolve().is_relative_to(ROOT), out


def test_import_triage_stays_light():
    code = (
        "import sys, triage, triage.cli;"
        "heavy = [m for m in ('triton', 'trl', 'transformers') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"import triage pulled in: {out}"
