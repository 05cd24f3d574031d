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
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_upward_imports(folder):
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
