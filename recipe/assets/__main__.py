"""``python -m recipe.assets [--cache DIR] [--json] [--force] [--deep-check]``: prepare the real offline assets
(see ``recipe.assets``) and print what the cache holds."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from recipe.assets import Assets, AssetSourceError, cache_bytes, prepare_assets
from recipe.assets.data import AssetDataError
from recipe.assets.target import TargetConversionError


def _print_summary(assets: Assets, total_seconds: float) -> None:
    from rich.console import Console  # import cost: rich
    from rich.table import Table  # import cost: rich

    table = Table(title=f"recipe assets in {assets.cache_dir}")
    for column in ("asset", "path", "contents", "status"):
        table.add_column(column, overflow="fold")
    contents = {
        "target": f"{assets.target_parameters:,} parameters (fp32, tied lm_head)",
        "conversations": f"{assets.conversation_count:,} records recovered, "
        f"{assets.dropped_tail_bytes:,} truncated tail bytes dropped",
        "prompts": f"{assets.prompt_count} questions, {len(assets.prompt_categories)} categories",
    }
    for name in ("target", "conversations", "prompts"):
        took = assets.seconds.get(name, 0.0)
        status = f"built in {took:.1f} s ({assets.reasons[name]})" if name in assets.rebuilt else "reused cache"
        table.add_row(name, str(getattr(assets, name)), contents[name], status)
    console = Console()
    console.print(table)
    verdict = "reused the cache, nothing built" if not assets.rebuilt else f"built {', '.join(assets.rebuilt)}"
    console.print(f"{verdict}; {cache_bytes(assets) / 2**20:,.1f} MiB cached; {total_seconds:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.assets",
                                     description="Prepare the real offline assets: SmolLM2 target, ShareGPT, MT-Bench.")
    parser.add_argument("--cache", type=Path, help="cache folder (default: $RECIPE_CACHE, else <repo>/.cache/recipe)")
    parser.add_argument("--force", action="store_true", help="rebuild every entry")
    parser.add_argument("--deep-check", action="store_true", help="re-hash cached files against their manifests")
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line of the three paths")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        assets = prepare_assets(args.cache, force=args.force, deep_check=args.deep_check)
    except (AssetSourceError, AssetDataError, TargetConversionError) as error:
        parser.exit(2, f"error: {error}\n")
    _print_summary(assets, time.perf_counter() - start)
    if args.json:
        print(assets.paths_json(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
