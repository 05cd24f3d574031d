"""Package layout: `kernels/` installs as `triage.kernels`, `trainers/` as `triage.trainers`,
`experiments/` as `triage.experiments` (so `triage ablate` works from an installed wheel).

Never a top-level `kernels` module (a PyPI package of that name exists and transformers imports it).
Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {
    "triage": "triage",
    "triage.kernels": "kernels",
    "triage.trainers": "trainers",
    "triage.experiments": "experiments",
}


def _subpackages(prefix: str, where: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(where)]


setup(
    package_dir=PACKAGE_DIR,
    packages=find_packages(include=["triage", "triage.*"])
    + _subpackages("triage.kernels", "kernels")
    + _subpackages("triage.trainers", "trainers")
    + _subpackages("triage.experiments", "experiments"),
)
