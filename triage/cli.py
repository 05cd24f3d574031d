"""The ``triage`` console script.

Each subcommand lives in its own module that exposes ``run(args) -> int`` and either
``parse_args(argv, prog, description)``, which parses its own flags (``triage demo``: its ``DemoConfig``
fields through ``trl.TrlParser``, which also reads ``--config file.yaml``), or ``add_arguments(parser)`` for
an argparse parser built here, where the flags are no dataclass's fields (``train`` and ``ablate`` layer
recipes and study files, ``diagnose`` picks a model source, ``explain`` stays in the torch-only core;
docs/experiments.md, "Command-line parsing"). Either way this module imports nothing beyond torch's layer.
Modules are imported only when their subcommand is chosen, so ``triage --help`` and ``triage explain``
never import TRL or Triton (the core layer stays torch-only; the CLI is the one place that dispatches
upwards, and it does so lazily by module name).

Errors: a user error — :data:`USER_ERRORS`, what the library raises for a bad config, recipe, file, path or
input (``ValueError``, ``OSError`` such as ``FileNotFoundError``, ``KeyError``) — prints one line
``triage: error: <message>`` on stderr and exits 2, like argparse's own usage errors. ``--debug`` (before or
after the command) re-raises it with its traceback. Anything else is a bug, not bad input: it is never
caught and shows its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from triage._version import __version__

#: exceptions the CLI reports as one line (exit 2): bad input, not bugs (module docstring)
USER_ERRORS = (ValueError, OSError, KeyError)
DEBUG_FLAG = "--debug"

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
        epilog=(
            f"commands:\n{lines}\n\nRun `triage COMMAND --help` for a command's options. A bad config, recipe, "
            "file or input prints one line, `triage: error: ...` (exit 2); --debug shows its traceback."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"triage-rl {__version__}")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    return parser


DEBUG_HELP = "show the traceback of an error instead of the one-line 'triage: error: ...'"


def _message(err: BaseException) -> str:
    """The error's text. A ``KeyError`` that carries a sentence gives it without the quotes ``str(KeyError)``
    adds; a bare missing key keeps its type (``KeyError: 'x'``), which says more than ``'x'``."""
    if isinstance(err, KeyError):
        text = err.args[0] if len(err.args) == 1 else None
        return text if isinstance(text, str) and " " in text else f"KeyError: {err}"
    return str(err) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while argv and argv[0] == DEBUG_FLAG:  # `triage --debug COMMAND ...`
        debug, argv = True, argv[1:]
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
    debug = debug or DEBUG_FLAG in rest
    try:
        return int(module.run(_parse(module, name, text, rest)) or 0)
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"triage: error: {_message(err)}", file=sys.stderr)
        return 2


def _parse(module, name: str, text: str, rest: list[str]):
    """The command's arguments: its own ``parse_args`` (module docstring), else the argparse namespace of
    ``add_arguments``. Both accept ``--debug``."""
    if hasattr(module, "parse_args"):
        return module.parse_args(rest, prog=f"triage {name}", description=text)
    parser = argparse.ArgumentParser(prog=f"triage {name}", description=text)
    module.add_arguments(parser)
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser.parse_args(rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
