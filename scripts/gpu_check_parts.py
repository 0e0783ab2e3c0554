"""The two child processes of ``scripts/gpu_check.py``: the fail-fast import stage and the 8B-shaped memory table.

``import_stage``: every carried wheel's top-level modules, every module of ``recipe`` and ``kernels``, and the
versions the device's Python sees, written to ``OUT/imports.json`` before any other stage starts; with CUDA, the
context's own footprint (``torch.cuda.mem_get_info`` after one small matrix product, with nothing else allocated).

``table_rows``: one TTT training step per length of a Llama-3.1-8B-shaped draft, the model built ONCE (its RoPE table
sized for the longest row) and each row's batch drawn on the device. A row runs only when its predicted seconds
(``row_estimate``: compiles expected for it plus its steps, scaled from the previous row's measured step) fit the
time the table has left; otherwise it is recorded "skipped" with the prediction, so the parent's hard cap never has
to kill a row. Each row records the allocator's peaks (``max_memory_allocated`` / ``max_memory_reserved``) beside
the driver's view (``torch.cuda.mem_get_info`` before and after the step): their difference is the memory the
planner's fixed overheads stand for (CUDA context, kernels' modules, workspaces). Rows are written to
``OUT/table.json`` as they finish.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("recipe", "kernels")
TABLE_MODULES = ("kernels.flex_attention", "recipe.bench.measure", "recipe.model.ttt", "recipe.plan")
"""What the table needs: when these import, the table runs even if another module failed."""
VERSIONS = ("torch", "triton", "transformers", "deepspeed", "datasets", "accelerate", "safetensors", "tokenizers",
            "pydantic", "pydantic_core", "hjson", "numpy", "pyarrow", "huggingface_hub", "typing_extensions")


# ---- the import stage ---------------------------------------------------------------------------------------------
def wheel_modules(wheel: Path) -> tuple[str, list[str]]:
    """(distribution name, its top-level importable names) of a wheel file: ``top_level.txt`` when the wheel has one,
    else the first path component of its files (packages, ``*.py`` and extension modules; ``*.dist-info``,
    ``*.data`` and ``*.pth`` left out)."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        found = set()
        if tops:
            found = {line.strip() for line in zf.read(tops[0]).decode().splitlines()}
        for name in names if not tops else ():
            top = name.split("/")[0]
            if top.endswith((".dist-info", ".data")):
                continue
            if "/" in name:
                found.add(top)
            elif name.endswith((".py", ".so")):
                found.add(top.split(".")[0])
    return wheel.name.split("-")[0], sorted(m for m in found if m.isidentifier())


def _try_import(name: str) -> str | None:
    try:
        importlib.import_module(name)
        return None
    except BaseException as exc:  # noqa: BLE001 - SystemExit/ImportError/anything: recorded per module
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}".strip()


def project_modules() -> list[str]:
    """Every module of ``PACKAGES`` (``__main__`` modules left out: importing one runs it)."""
    sys.path.insert(0, str(ROOT))
    names = []
    for package in PACKAGES:
        names.append(package)
        module = importlib.import_module(package)
        names += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")
                  if not m.name.endswith(".__main__")]
    return names


def import_stage(wheels: Path, out: Path, need_cuda: bool = True) -> int:
    """Import every carried wheel's modules, then every project module; write ``out/imports.json``
    (``{"python", "versions", "wheels", "modules": {name: None | error}, "failed", "table_ok", "cuda"}``) and
    return 0 when nothing failed (and, with ``need_cuda``, CUDA works), 1 otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    started = time.monotonic()
    report = {"python": sys.version.split()[0], "executable": sys.executable, "wheels": {}, "modules": {}}
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        dist, modules = wheel_modules(wheel)
        report["wheels"][wheel.name] = {m: _try_import(m) for m in modules}
        first = modules and sys.modules.get(modules[0])
        report["wheels"][wheel.name]["<file>"] = getattr(first, "__file__", None) if first else None
    try:
        names = project_modules()
    except BaseException as exc:  # noqa: BLE001
        names, report["modules"]["<walk>"] = [], f"{type(exc).__name__}: {exc}"
    for name in names:
        report["modules"][name] = _try_import(name)
    for py_file in ("run.py", "scripts/gpu_check.py"):
        try:
            compile((ROOT / py_file).read_text(), py_file, "exec")
        except SyntaxError as exc:
            report["modules"][py_file] = f"SyntaxError: {exc}"
    versions = {}
    for dist in VERSIONS:
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    report["versions"] = versions
    failed = [f"{w}:{m}" for w, mods in report["wheels"].items() for m, err in mods.items()
              if m != "<file>" and err] + [m for m, err in report["modules"].items() if err]
    report["failed"] = failed
    report["table_ok"] = not any(report["modules"].get(m) for m in TABLE_MODULES) and "<walk>" not in report["modules"]
    report["cuda"] = _cuda_probe()
    if need_cuda and not report["cuda"].get("device"):
        failed.append(f"cuda: {report['cuda'].get('error') or 'no CUDA device'}")
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "imports.json").write_text(json.dumps(report, indent=1))
    for item in failed:
        print(f"import failed: {item}: {report['modules'].get(item) or ''}", file=sys.stderr)
    print(f"imports: {len(report['modules'])} modules, {len(report['wheels'])} wheels, {len(failed)} failed, "
          f"cuda {report['cuda'].get('device')}")
    return 1 if failed else 0


def _cuda_probe() -> dict:
    """Device, CUDA version and the context's footprint (``mem_get_info`` used bytes after one small product)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {"device": None, "torch_cuda": torch.version.cuda}
        x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        (x @ x).sum().item()
        free, total = torch.cuda.mem_get_info()
        return {"device": torch.cuda.get_device_name(0), "torch_cuda": torch.version.cuda,
                "capability": list(torch.cuda.get_device_capability(0)), "total_bytes": total,
                "context_used_bytes": total - free, "allocator_reserved_bytes": torch.cuda.memory_reserved()}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


# ---- the table ----------------------------------------------------------------------------------------------------
def step_units(length: int, crossover: float) -> float:
    """A step's time at ``length`` tokens in units of a 4096-token step: linear layers ~ n, attention ~ n², equal at
    ``crossover`` tokens, so time ~ n (1 + n / crossover)."""
    return length * (1 + length / crossover) / (4096 * (1 + 4096 / crossover))


def gpu_row_estimate(length: int, index: int, last: dict | None, est: dict) -> float:
    """Predicted seconds of a table row: the flex forward + backward compiles it triggers (the first row compiles
    the kernels with every size symbolic: ``kernels.flex_attention``, "Compile policy"), plus
    ``est["steps"][length]`` steps (from the previous row's measured step scaled by ``step_units``, before any
    measurement ``est["row_step"]`` per 4k-step unit), plus drawing the batch."""
    compiles = est["flex_fwd"] + est["flex_bwd"] if index == 0 else 0
    units = step_units(length, est["attn_crossover"])
    if last and last.get("seconds"):
        step = last["seconds"] * units / step_units(last["length"], est["attn_crossover"])
    else:
        step = est["row_step"] * units
    return compiles + est["steps"][length] * step + est["row_batch"]


def table_rows(plan: list[tuple[int, int]], spec_of, cap: float, out: Path, est: dict, smoke: bool,
               plans: dict) -> list[dict]:
    """Run the table rows ``plan`` = [(length, row cap s)] within ``cap`` seconds from now; ``spec_of(length)`` the
    row's ``BenchSpec``. Returns the rows (also written to ``out/table.json`` after each)."""
    import torch

    from kernels.flex_attention import flex_compile_stats
    from recipe.bench.measure import build_model, random_batch, time_step

    started = time.monotonic()
    device = torch.device("cpu" if smoke else "cuda")
    rows, path, last, banked = [], out / "table.json", None, 0.0
    t0 = time.monotonic()
    model = build_model(spec_of(max(n for n, _ in plan)), device)  # once; the RoPE table covers the longest row
    model_seconds = round(time.monotonic() - t0, 1)
    for index, (length, row_cap) in enumerate(plan):
        spec = spec_of(length)
        left = cap - (time.monotonic() - started) - est["table_margin"]
        allowed = min(row_cap + banked, left)
        predicted = 0.0 if smoke else gpu_row_estimate(length, index, last, est)
        row = {"length": length, "cap_s": row_cap, "allowed_s": round(allowed, 1), "predicted_s": round(predicted, 1),
               "spec": dataclasses.asdict(spec), "plan": plans.get(str(length)), "model_build_s": model_seconds}
        if predicted > allowed:
            row.update(status="skipped", detail=f"predicted {predicted:.0f} s > {allowed:.0f} s the table has left "
                                                 "for it; not started")
        else:
            row.update(_one_row(model, spec, device, random_batch, time_step))
            if row["status"] == "ok":
                last = {"length": length, "seconds": row["seconds"]}
        banked = max(0.0, allowed - row.get("seconds_wall", 0.0))
        row["flex"] = flex_compile_stats()
        rows.append(row)
        path.write_text(json.dumps(rows, indent=1))
    return rows


def _mem(torch) -> dict:
    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


def _one_row(model, spec, device, random_batch, time_step) -> dict:
    """Draw the batch on ``device``, time ``spec.steps`` steps; the row's record (errors caught and recorded), with
    its speed (``recipe.plan.spec.spec_speed``: ``positions_per_s``, ``supervised_tokens_per_s``,
    ``model_tflops_per_gpu``, ``hardware_tflops_per_gpu``, ``mfu`` against the device's bf16 peak)."""
    import torch

    from recipe.model.flops import run_peak_tflops
    from recipe.plan.spec import DTYPES, spec_speed

    cuda = device.type == "cuda"
    row, t0, batch = {}, time.monotonic(), None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["mem_before_batch"] = _mem(torch)
        batch = random_batch(spec, device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the float32 draws' blocks, freed, are not the step's
            row["mem_before_step"] = _mem(torch)
        row.update(time_step(model, batch, spec.steps), status="ok")
        # positions and supervised tokens a second, model/hardware TFLOP/s a GPU and MFU (recipe.model.flops)
        row.update(spec_speed(spec, row["seconds"], run_peak_tflops(device, DTYPES[spec.dtype])))
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", detail=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - recorded, the next row still runs
        row.update(status="error", detail=f"{type(exc).__name__}: {str(exc)[:500]}",
                   traceback=traceback.format_exc()[-2000:])
    if cuda:
        torch.cuda.synchronize()
        # the driver's view with the step's cached blocks still held, beside the allocator's peaks
        row.update(mem_after_step=_mem(torch), max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_reserved=torch.cuda.max_memory_reserved())
        row["non_allocator_bytes"] = row["mem_after_step"]["used"] - row["mem_after_step"]["reserved"]
    del batch
    if cuda:
        torch.cuda.empty_cache()
    row["seconds_wall"] = round(time.monotonic() - t0, 1)
    return row


def local_action(args, actions: dict) -> int | None:
    """The CPU-side modes every GPU script shares (``--dry-run``, ``--prepare``, ``--collect``, ``--plan-rows``):
    ``actions`` maps a flag's attribute name to a callable of its value that returns the exit code (an int) or what
    it wrote (a path, a list of paths, printed as ``wrote PATH``; exit 0). The first flag that is set runs; None
    when none is (the device run goes on)."""
    for flag, action in actions.items():
        value = getattr(args, flag, None)
        if not value:
            continue
        result = action(value)
        if isinstance(result, int):
            return result
        for path in result if isinstance(result, (list, tuple)) else [result]:
            print(f"wrote {path}")
        return 0
    return None


def output_folder(args, default: str) -> Path:
    """The device run's output folder: ``--out``, else ``$OUT``, else ``default``; created."""
    out = args.out or Path(os.environ.get("OUT") or default)
    out.mkdir(parents=True, exist_ok=True)
    return out
