"""Sparse anchors (``memory.sparse_anchors``) on one GPU with the flex kernel: exact against the dense path, and
their time and memory, in one device call.

    python scripts/gpu_sparse_check.py [--smoke] [--out DIR]

Two parts, each row written to ``OUT/sparse_check.json`` as it finishes:

1. ``exact``: an 8B-shaped draft (the GPU check's table geometry: hidden 4096, 32/8 heads of 128, MLP 14336,
   V_d 32000, K = 7) in **fp32** at 4k tokens, chunked loss + step checkpointing, flex attention, one forward and
   backward with the switch off and on from the same weights and batch, for the ShareGPT-like and the 10 %-supervised
   masks (``recipe.plan.spec.supervised_mask``): the largest relative difference of the per-step loss sums and of
   every parameter gradient (max |a − b| / max |b|).
2. ``speed``: the same draft in **bf16** at 32k tokens, 3 steps per (mask, switch): seconds per step after the first
   and ``max_memory_allocated``, sparse / dense.

``--smoke`` runs the same code at tiny sizes on the CPU with the tiled kernel (the tests). No deadline of its own:
the device call's ``timeout`` bounds it. On an H200 (2026-12-04) the exact part and the first speed row took 181 s
(each model is built afresh on the CPU and moved), so give the whole call 300 s; the JSON is rewritten after every
row. Exit 1 when a row failed or sparse and dense differ by more than 1e-5 (loss) or 1e-4 (gradients, relative).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipe.bench.measure import build_model, random_batch, time_step  # noqa: E402
from recipe.plan.spec import BenchSpec  # noqa: E402
from recipe.model.ttt import step_weights  # noqa: E402

DRAFT_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                vocab=128256, target_hidden=4096)
DRAFT_SMOKE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, draft_vocab=96, vocab=128,
                   target_hidden=48)
MASKS = ("sharegpt", "long10")


def _spec(smoke: bool, length: int, dtype: str, mask: str, sparse: bool, steps: int) -> BenchSpec:
    return BenchSpec(seq_len=length, layout="chunked+ckpt", ttt_steps=3 if smoke else 7, dtype=dtype,
                     device="cpu" if smoke else "cuda", loss_chunk_size=32 if smoke else 4096,
                     attention_tile=32 if smoke else 1024, attention_backend="tiled" if smoke else "flex",
                     steps=steps, mask=mask, sparse_anchors=sparse, **(DRAFT_SMOKE if smoke else DRAFT_8B))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def exact_row(smoke: bool, mask: str) -> dict:
    """Dense vs sparse from the same weights (``build_model`` seeds them) and batch: loss sums and every gradient."""
    length = 128 if smoke else 4096
    device = torch.device("cpu" if smoke else "cuda")
    outs = {}
    for sparse in (False, True):
        spec = _spec(smoke, length, "fp32", mask, sparse, 1)
        model, batch = build_model(spec, device), random_batch(spec, device)
        out = model(batch)
        (step_weights(out.loss_sum_K.shape[0]).to(out.loss_sum_K) * out.loss_sum_K).sum().backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        outs[sparse] = (out.loss_sum_K.detach().float().cpu(), out.valid_K.detach().cpu(), grads)
        del model, batch, out
    (loss_d, valid_d, g_d), (loss_s, valid_s, g_s) = outs[False], outs[True]
    grad_rel = {n: _rel(g_s[n], g_d[n]) for n in g_d}
    return {"mask": mask, "length": length, "dtype": "fp32", "loss_sum_K": loss_d.tolist(),
            "valid_K": valid_d.tolist(), "valid_equal": bool(torch.equal(valid_s, valid_d)),
            "loss_rel": _rel(loss_s, loss_d), "grad_rel_max": max(grad_rel.values()), "grad_rel": grad_rel,
            "same_params": sorted(g_s) == sorted(g_d)}


def speed_row(smoke: bool, mask: str) -> dict:
    """bf16 seconds per step and allocator peak, dense and sparse."""
    length = 256 if smoke else 32768
    device = torch.device("cpu" if smoke else "cuda")
    row = {"mask": mask, "length": length, "dtype": "bf16"}
    for sparse in (False, True):
        spec = _spec(smoke, length, "bf16", mask, sparse, 3)
        model, batch = build_model(spec, device), random_batch(spec, device)
        row["sparse" if sparse else "dense"] = time_step(model, batch, spec.steps)
        del model, batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["time_ratio"] = row["sparse"]["seconds"] / row["dense"]["seconds"]
    row["peak_ratio"] = row["sparse"]["peak_bytes"] / row["dense"]["peak_bytes"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_sparse_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, tiled kernel (the tests)")
    p.add_argument("--out", type=Path, help="output folder (default $OUT, else ./gpu_check_out)")
    args = p.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT", "gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "exact": [], "speed": []}
    start = time.time()
    for part, fn in (("exact", exact_row), ("speed", speed_row)):
        for mask in MASKS:
            try:
                report[part].append(fn(args.smoke, mask))
            except Exception as exc:  # a failing row is recorded; the others still run
                report[part].append({"mask": mask, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            report["elapsed_s"] = round(time.time() - start, 1)
            (out / "sparse_check.json").write_text(json.dumps(report, indent=1) + "\n")
            row = report[part][-1]
            print(part, mask, {k: v for k, v in row.items() if k in ("loss_rel", "grad_rel_max", "valid_equal",
                                                                     "time_ratio", "peak_ratio", "error")},
                  flush=True)
    failed = any("error" in r for r in report["exact"] + report["speed"])
    inexact = any(r.get("loss_rel", 0) > 1e-5 or r.get("grad_rel_max", 0) > 1e-4 for r in report["exact"])
    return 1 if failed or inexact else 0


if __name__ == "__main__":
    sys.exit(main())
