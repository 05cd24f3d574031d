"""The ``triage`` console script.

Each subcommand lives in its own module that exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand is chosen, so ``triage --help`` and ``triage explain``
never import TRL or Triton (the core layer stays torch-only; the CLI is the one place that dispatches
upwards, and it does so lazily by module name).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from triage._version import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("triage.explain", "print the class / weight table a TriageConfig implies"),
    "demo": (
        "triage.experiments.demo",
        "the main job: a few TRIAGE GRPO steps on a tiny local model (CPU ok)",
    ),
    "train": ("triage.experiments.train", "train with TriageGRPOTrainer from a recipe YAML"),
    "diagnose": ("triage.trainers.diagnose", "find where learner and sampler diverge (gap table)"),
    "ablate": ("triage.experiments.ablate", "TRIAGE vs vanilla GRPO (and baselines) ablation"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="triage",
        description="triage-rl: mismatch-aware low-precision RL for LLMs.",
        epilog=f"commands:\n{lines}\n\nRun `triage COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"triage-rl {__version__}")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv[:1])  # handles --version / --help / unknown command
        top.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module_name, text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            print(f"triage {name}: not available in this version ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"triage {name}", description=text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
