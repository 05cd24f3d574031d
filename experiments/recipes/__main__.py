"""``python -m triage.experiments.recipes PRESET/ARM|FILE [--cpu] [--set KEY=VALUE ...] [-o OUT.yaml]``: print
or write the merged, validated recipe (the flat YAML ``triage train --config`` reads); ``--cpu`` layers the CPU
overrides (``cpu.yaml``) as ``triage train --cpu`` does; ``--list`` lists names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triage.experiments.recipes import dump_recipe, load_recipe, recipe_names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triage.experiments.recipes", description=__doc__)
    parser.add_argument("recipe", nargs="?", help="PRESET/ARM (e.g. qwen3-4b/triage) or a recipe YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field (dotted keys reach into mappings; VALUE is YAML)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="layer the CPU overrides (cpu.yaml) over the recipe"
    )
    parser.add_argument("-o", "--output", type=Path, help="write the recipe here instead of stdout")
    parser.add_argument("--list", action="store_true", help="list the shipped PRESET/ARM names")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(recipe_names()))
        return 0
    if not args.recipe:
        parser.error("a recipe (PRESET/ARM or FILE) is required")
    text = dump_recipe(load_recipe(args.recipe, args.overrides, cpu=args.cpu))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
