"""scripts/gpu_perf_check.py on the CPU: the dry run's schedule fits one device call on an H100 and an H200 (rows the
planner says do not fit are skipped, not scheduled), the stand-in for ``auto`` takes the first switch set that fits,
a row that cannot finish in time is skipped before it starts, the profile's categories add up to the step's wall
time, SpecForge's own step (its wheel, our adapter) gives our loss and gradients under the convention mapping in
fp32, and (slow) the smoke run writes every row, survives a child that dies mid-row, and its collected page quotes
its JSON."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.cases import assert_rel_close
from helpers.tolerance import BF16_ROUNDED, FP32_REORDERED, within
from helpers.training import ROOT

sys.path.insert(0, str(ROOT))

from scripts import gpu_perf_rows as rows_mod  # noqa: E402
from scripts.gpu_perf_profile import CATEGORIES, breakdown  # noqa: E402

GIB = 2 ** 30
WHEEL_SHA256 = "fbc79517adf483c6a8beea52561b1a8c8c8a99a54c820b47d2033a73966b55b0"


def _check():
    spec = importlib.util.spec_from_file_location("gpu_perf_check", ROOT / "scripts" / "gpu_perf_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def specforge_wheel(tmp_path_factory):
    """SpecForge's wheel: the carried ``.whl/`` copy (``bash scripts/gpu_wheels.sh``), else the package registry's
    (``pip download --no-deps``, cached under ``$RECIPE_CACHE/wheels``); checked against its sha256. Skips when
    neither is reachable (no registry access)."""
    import hashlib

    from recipe.assets import default_cache_dir
    from scripts.gpu_perf_specforge import WHEEL

    for folder in (ROOT / ".whl", default_cache_dir() / "wheels"):
        if (folder / WHEEL).is_file():
            break
    else:
        folder = default_cache_dir() / "wheels"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "specforge==0.2.0", "-d",
                               str(folder)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"SpecForge's wheel is not in .whl/ and the registry did not give it: {done.stderr[-300:]}")
    wheel = folder / WHEEL
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == WHEEL_SHA256
    return wheel


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_dry_run_schedules_every_row_within_the_budget(gpu, capsys):
    check = _check()
    assert check.main(["--dry-run", "--gpu", gpu]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if " est " in line]
    assert listed == ["imports", "child", *[r.name for r in rows_mod.ROWS], "total"]
    ends = [float(line.split(" end ")[1].split()[0]) for line in lines if " end " in line]
    assert ends == sorted(ends) and ends[-1] <= check.BUDGET_S <= 540 < 600
    total = next(line for line in lines if line.startswith("total"))
    assert total.endswith("fits") and float(total.split()[2]) == ends[-1]
    skipped = {line.split()[0] for line in lines if "skipped:" in line}
    assert "specforge_128k" in skipped and ("specforge_32k" in skipped) == (gpu == "h100")
    assert all(float(line.split()[2]) == 0 for line in lines if "skipped:" in line)  # they cost nothing
    first = next(line for line in lines if line.startswith("ours_auto_4x2048"))
    assert "compile" in first and "full" in first  # the first row pays the compiles; 4 × 2048 recomputes nothing


def test_stand_in_takes_the_cheapest_set_the_plan_fits():
    from recipe.plan.spec import spec_flops
    from recipe.plan.states import gpu_bytes

    row, Switches = rows_mod.ROW["ours_auto_32k"], rows_mod.Switches
    sets = rows_mod.candidates(row)
    assert len(sets) == 12 and sets[0] == Switches() and all(s.chunked or s.teacher_once for s in sets)
    flops = {s: spec_flops(rows_mod.bench_spec(row, False, s, "cuda")).hardware_total for s in sets}

    def plans(fitting):
        return {"rows": {rows_mod.plan_key(row, s): {"total": (1 if fitting(s) else 200) * GIB} for s in sets}}
    assert rows_mod.stand_in(row, 100 * GIB, plans(lambda s: True)) == Switches()  # nothing recomputed
    second = rows_mod.stand_in(row, 100 * GIB, plans(lambda s: s != Switches()))
    assert second == Switches(mlp_tiles=True) and flops[second] == min(v for s, v in flops.items() if s != Switches())
    assert rows_mod.stand_in(row, 100 * GIB, plans(lambda s: False)) == Switches(
        checkpoint=True, chunked=True, teacher_once=False, mlp_tiles=True)  # none fits: the one saving the most
    committed = json.loads(rows_mod.PLAN_FILE.read_text())  # the plan file's recorded choices are the rule's
    for gpu, picks in committed["stand_in"].items():
        for r in [r for r in rows_mod.ROWS if r.kind == "ours" and r.flip is None]:
            assert picks[f"{r.batch}x{r.length}"] == rows_mod.stand_in(r, gpu_bytes(gpu), committed).label
    switches, source = rows_mod.auto_switches(row, False, "cuda", 100 * GIB, plans(lambda s: True))
    assert switches == Switches() and switches.compile and switches.flex_dynamic and "stand-in" in source
    assert rows_mod.flipped(switches, "flex_static").flex_dynamic is False
    assert rows_mod.flipped(switches, "checkpoint").layout == "ckpt"


def test_auto_rows_take_the_recipes_own_resolution():
    """The hook reads the recipe's ``MemoryOptions.resolve`` (made by ``--plan-rows`` for an H100 and an H200);
    the CPU smoke calls it without device memory (its CPU values: nothing recomputed)."""
    plans = json.loads(rows_mod.PLAN_FILE.read_text())
    autos = [r for r in rows_mod.ROWS if r.kind == "ours" and r.flip is None]
    for gpu in ("h100", "h200"):
        for r in autos:
            entry = plans["recipe_auto"][gpu][f"{r.batch}x{r.length}"]
            switches, source = rows_mod.auto_switches(r, False, "cuda", None, plans, gpu)
            assert entry["fits"] and switches == rows_mod.Switches(**entry["switches"]) and "recipe auto" in source
            assert plans["rows"][rows_mod.plan_key(r, switches)]["total"] > 0  # its ablations are gated on these
    small, source = rows_mod.auto_switches(autos[0], True, "cpu", None, {})
    assert small == rows_mod.Switches(compile=False) and "recipe auto (cpu" in source
    assert rows_mod.auto_switches(autos[1], False, "cuda", 100 * GIB, plans, "a100")[1].startswith("stand-in")


def test_a_row_that_cannot_finish_or_fit_is_not_started():
    check = _check()
    assert "not started" in check.skip_reason(61.0, 60.0, None, None)
    assert "GiB" in check.skip_reason(1.0, 60.0, {"planned_bytes": 90 * GIB, "fits": False}, 80 * GIB)
    assert check.skip_reason(59.0, 60.0, {"planned_bytes": 70 * GIB, "fits": True}, 80 * GIB) is None


def test_packing_row_lays_out_the_cpu_mixes_as_the_run_does():
    """The packing row reads the CPU measurement's first four mixes (the smoke's scaled to 64 tokens), lays each out
    as the batch builder does at one rank (padded: 8 rows of the longest; packed: one row of all, both rounded up to
    2), compares with the CPU's ratio of the same mixes (0.71, its docstring's number), and pays the packed
    layout's compile once per process."""
    from scripts import gpu_perf_packing as pk

    mixes = pk.packing_mixes(False)
    assert mixes == json.loads(pk.CPU_RESULT.read_text())["mixes"][:4] and {len(m) for m in mixes} == {8}
    small = pk.packing_mixes(True)
    assert small[0] == [64, 63, 64, 48, 64, 64, 64, 64] and min(n for m in small for n in m) >= 2
    for mix in mixes + small:
        lay = pk.layouts(mix)
        assert (lay["padded"].rows, lay["padded"].seq) == (8, max(mix) + max(mix) % 2)
        assert (lay["packed"].rows, lay["packed"].seq) == (1, sum(mix) + sum(mix) % 2) and lay["packed"].packed
        assert lay["packed"].tokens == lay["padded"].tokens == sum(mix)
    assert pk._cpu_total([{"mix": m} for m in range(4)]) == pytest.approx(0.71, abs=0.005)
    assert pk.cpu_ratios()["all"] == pytest.approx(0.68, abs=0.005)
    row, done = rows_mod.ROW["packing_8x2048"], set()
    first = pk.packing_estimate(row, rows_mod.Switches(), done, rows_mod.ESTIMATES_S, 1.0)
    again = pk.packing_estimate(row, rows_mod.Switches(), done, rows_mod.ESTIMATES_S, 1.0)
    assert done == {"packing"} and "compile" in first and "compile" not in again
    assert first["steps"] == again["steps"] > 0 and first["batch"] == 8 * rows_mod.ESTIMATES_S["packing_batch"]


def test_profile_breakdown_puts_kernels_in_their_phase_and_counts_idle():
    windows = {"forward": (0.0, 100.0), "backward": (100.0, 300.0), "optimizer": (300.0, 320.0)}
    spans = [("triton_tem_fused_flex_0", 0.0, 30.0), ("nvjet_hsh_gemm", 20.0, 40.0),  # overlapping: union 60
             ("triton_red_fused__log_softmax_1", 70.0, 10.0), ("triton_tem_fused_1", 100.0, 50.0),
             ("sm90_xmma_gemm_bf16", 150.0, 100.0), ("triton_poi_fused_mul_2", 260.0, 10.0),
             ("multi_tensor_apply_kernel", 300.0, 15.0)]
    b = breakdown(spans, windows, overlapping=True)
    assert b["wall_ms"] == pytest.approx(0.32)
    ms = {k: v * 1e3 for k, v in b["ms"].items()}
    assert ms == pytest.approx({"flex_forward": 30, "flex_backward": 50, "matmul": 140, "loss": 10,
                                "elementwise_other": 10, "optimizer": 15, "idle": 320 - (70 + 160 + 15)})
    assert set(b["share"]) == set(CATEGORIES)
    cpu = breakdown([("aten::mm", 10.0, 50.0), ("aten::_softmax", 70.0, 20.0)], {"forward": (0.0, 100.0)}, False)
    assert cpu["ms"]["idle"] * 1e3 == pytest.approx(30) and cpu["ms"]["matmul"] * 1e3 == pytest.approx(50)


def _tiny_pair(sf, backend: str):
    """Our fp32 TTT model and SpecForge's draft from the same weights; a batch with a random draft vocabulary, a
    full target head whose greedy token falls outside it for some rows, and a partial loss mask."""
    from recipe.export import export_tensors
    from recipe.model.draft import Eagle3Draft
    from recipe.model.ttt import TTTModel, make_ttt_batch
    from recipe.plan.spec import BenchSpec, spec_draft_config
    from scripts import gpu_perf_specforge as sfa

    b, s, k, v, vd, ht = 2, 48, 3, 128, 96, 48
    config = spec_draft_config(BenchSpec(seq_len=s, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                                         draft_vocab=vd, vocab=v, target_hidden=ht, ttt_steps=k))
    draft = Eagle3Draft(config, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(vd), t2d)
    draft.load_target_embeddings(torch.randn(v, 64, generator=g))
    full = torch.randn(v, ht, generator=g)
    theirs = sfa.build_draft(sf, config, export_tensors(draft.state_dict()), draft.embed_tokens.weight.detach(),
                             "cpu", torch.float32, backend)
    raw = dict(input_ids=torch.randint(0, v, (b, s), generator=g), loss_mask=torch.rand(b, s, generator=g) > 0.3,
               aux=torch.randn(b, s, 3 * ht, generator=g), last_hidden=torch.randn(b, s, ht, generator=g))
    in_vocab = t2d[(raw["last_hidden"] @ full.T).argmax(-1)]
    ours = TTTModel(draft, full[ids].clone(), sparse_anchors=False)
    batch = make_ttt_batch(raw["input_ids"], raw["loss_mask"], torch.ones(b, s, dtype=torch.bool), raw["aux"],
                           raw["last_hidden"], in_vocab, k)
    step = sfa.SpecForgeStep(sf, theirs, sfa.full_target_head(full[ids], ids, v, full), k, backend, eager=True)
    return ours, batch, step, raw, (b, s, k), bool((~in_vocab).any())


@pytest.mark.slow
def test_specforge_step_equals_ours_under_the_convention_mapping(specforge_wheel, monkeypatch):
    """fp32, SpecForge's sdpa path: its per-step loss × B·S is our loss sum of the step, and the gradient of its
    objective (each step's mean over B·S) equals ours with each step divided by B·S, every parameter, within
    FP32_REORDERED (the same function summed in another order: its attention softmax over the concatenated scores
    against our LSE merge, its full-vocabulary head's rows against our draft rows). Without the mask mapping the
    losses differ by far more (the control); its flex path's forward (eager, no gradient on the CPU) agrees too."""
    monkeypatch.syspath_prepend(str(specforge_wheel))
    from recipe.model.ttt import step_weights
    from scripts import gpu_perf_specforge as sfa

    sf = sfa.load_specforge()
    assert sf.version == "0.2.0" and sf.loss_stand_in  # no CUDA here: SpecForge's own reference of its kernel
    ours, batch, step, raw, (b, s, k), some_out_of_vocab = _tiny_pair(sf, "sdpa")
    assert some_out_of_vocab and 0 < int(raw["loss_mask"].sum()) < b * s  # both conventions are exercised
    out = ours(batch)
    ((step_weights(k) * out.loss_sum_K).sum() / (b * s)).backward()
    res = step.forward(sfa.specforge_batch(sf, raw["input_ids"], raw["loss_mask"], raw["aux"], raw["last_hidden"]))
    res.loss.backward()
    theirs_K = sfa.specforge_loss_sums(torch.stack([p.detach() for p in res.metrics["plosses"]]), b, s)
    assert_rel_close(theirs_K.float(), out.loss_sum_K.detach(), FP32_REORDERED, "loss sums")
    grads = {n: p.grad for n, p in step.draft.named_parameters() if p.grad is not None}
    mine = {n: p.grad for n, p in ours.draft.named_parameters() if p.grad is not None}
    assert set(grads) == set(mine) and len(mine) == 13
    for name, grad in mine.items():
        assert_rel_close(grads[name], grad, FP32_REORDERED, name)
    raw_mask = sf.contracts.TrainBatch(sample_ids=["0", "1"], strategy="eagle3", metadata={"target_repr":
                                       "hidden_state"}, tensors={**sfa.specforge_batch(sf, raw["input_ids"],
                                       raw["loss_mask"], raw["aux"], raw["last_hidden"]).tensors,
                                       "loss_mask": raw["loss_mask"].long()})
    with torch.no_grad():
        unmapped = sfa.specforge_loss_sums(torch.stack(step.forward(raw_mask).metrics["plosses"]), b, s)
    assert ((unmapped.float() - out.loss_sum_K.detach()).abs() / out.loss_sum_K.detach()).max() > 1e-3
    flex_ours, flex_batch, flex_step, *_ = _tiny_pair(sf, "flex_attention")
    with torch.no_grad():
        flex = flex_step.forward(sfa.specforge_batch(sf, raw["input_ids"], raw["loss_mask"], raw["aux"],
                                                     raw["last_hidden"]))
    flex_K = sfa.specforge_loss_sums(torch.stack(flex.metrics["plosses"]), b, s)
    assert_rel_close(flex_K.float(), out.loss_sum_K.detach(), FP32_REORDERED, "flex loss sums")


@pytest.mark.slow
def test_smoke_run_writes_every_row_and_its_page(specforge_wheel, tmp_path, monkeypatch):
    """Every row at tiny sizes on the CPU, a child made to die as it starts one row (recorded "crashed", a second
    child runs the rest), the JSON complete, then ``--collect`` writes the page whose tables quote that JSON."""
    check = _check()
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{specforge_wheel}{os.pathsep}{ROOT}",
               **{check.CRASH_ENV: "attention_tiled_4k"})
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_perf_check.py"), "--smoke", "--out", str(out),
                           "--wheels", str(tmp_path / "no_wheels")], env=env, capture_output=True, text=True,
                          timeout=900)
    report = json.loads((out / check.REPORT).read_text())
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # the crashed row makes it fail
    by = {r["name"]: r for r in report["rows"]}
    assert sorted(by) == sorted(r.name for r in rows_mod.ROWS) and len(report["rows"]) == len(by)
    assert by.pop("attention_tiled_4k")["status"] == "crashed" and len(report["children"]) == 2
    assert {r["status"] for r in by.values()} == {"ok"}, {n: r.get("detail") for n, r in by.items()}
    for r in [r for r in by.values() if r["kind"] in ("ours", "specforge")]:
        assert r["seconds"] > 0 and r["positions_per_s"] == pytest.approx(r["batch"] * r["length"] / r["seconds"])
        assert r["supervised_tokens_per_s"] > 0 and r["model_tflops_per_gpu"] > 0 and "mfu" in r
    assert by["ours_auto_4x2048"]["specforge_ratio"] == pytest.approx(
        by["ours_auto_4x2048"]["seconds"] / by["specforge_4x2048"]["seconds"])
    within(by["specforge_4x2048"]["loss_check_bf16"]["max_rel"], BF16_ROUNDED, "bf16 loss check")
    for name in ("profile_4x2048", "profile_32k"):
        shares = by[name]["breakdown"]["share"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.02) and shares["matmul"] > 0
        assert (out / by[name]["table_file"]).is_file()
    assert by["ablate_flex_static_4x2048"]["switches"]["flex_dynamic"] is False
    packing = by["packing_8x2048"]
    from scripts.gpu_perf_packing import packing_mixes

    assert [e["lengths"] for e in packing["mixes"]] == packing_mixes(True)
    for e in packing["mixes"]:
        assert e["packed"]["shape"][0] == 1 and e["padded"]["shape"][0] == 8 and e["positions_packed_vs_padded"] < 1
        assert e["packed_vs_padded"] == pytest.approx(e["packed"]["seconds"] / e["padded"]["seconds"])
    assert packing["packed_vs_padded"] == pytest.approx(packing["packed_seconds"] / packing["padded_seconds"])
    same = packing["loss_check_bf16"]
    assert same["valid_equal"] and min(same["valid_K"]) > 0 and len(same["padded"]) == rows_mod.TTT_STEPS[True]
    within(same["max_rel"], BF16_ROUNDED, "packed against padded, bf16 forward")
    assert check.main(["--collect", str(out), "--results-dir", str(tmp_path / "results")]) == 0
    page = tmp_path / "results" / f"perf_{report['info']['date']}.md"
    import test_docs

    monkeypatch.setattr(test_docs, "ROOT", tmp_path)
    assert len(test_docs.cited_tables(page)) >= 4 and test_docs.table_mismatches(page) == []
    assert "ours / SpecForge ≤ 0.8:" in page.read_text()
