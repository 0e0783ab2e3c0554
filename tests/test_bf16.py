"""bf16 is real: the long-run configs carry the memory switches and reduce/accumulate gradients in fp32 where DeepSpeed
allows it, every matmul of a bf16 step outside the attention kernel runs in bf16, bf16 ZeRO-3 training on 2 gloo
ranks with the real SmolLM2 target tracks the fp32 run at dp2, tp2 and cp2, and ``python -m recipe.eval`` runs the
bf16 draft it exports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from helpers.cases import build_case
from helpers.ranks import run_ranks
from helpers.training import ROOT, run_training
from helpers.tolerance import within

from recipe.config_memory import PLANNED

STEPS = 6


def test_long_run_configs_have_the_memory_switches():
    """Every shipped config a long run would use (bf16, or tp/cp > 1) sets the memory switches: the bf16 ones "auto"
    (chosen at start for the longest sample and the device, recipe.config_memory), the fp32 tp/cp ones the chunked
    loss, step checkpointing and attention tiles."""
    long_run = []
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        parallel = cfg.get("parallelism", {})
        if (cfg.get("bf16") or {}).get("enabled") or parallel.get("tp_size", 1) > 1 or parallel.get("cp_size", 1) > 1:
            long_run.append(path.name)
            memory = cfg.get("memory") or {}
            if (cfg.get("bf16") or {}).get("enabled"):
                assert all(memory.get(key) == "auto" for key in PLANNED), path
                continue
            assert isinstance(memory.get("loss_chunk_size"), int) and memory["loss_chunk_size"] > 0, path
            assert memory.get("checkpoint_ttt_steps") is True, path
            assert isinstance(memory.get("attention_tile_size"), int) and memory["attention_tile_size"] > 0, path
    assert {"zero0_bf16.json", "zero3_bf16.json", "zero3_tp2_cp2.json"} <= set(long_run)


def test_bf16_configs_reduce_and_accumulate_in_fp32():
    """DeepSpeed reduces gradients in the bf16 dtype unless ``communication_data_type`` says fp32, and accumulates
    them in bf16 unless ``data_types.grad_accum_dtype`` is fp32; 0.19.8 refuses the latter without ZeRO ("unsupported
    mix"), so the ZeRO-0 config reduces in fp32 and says why it accumulates in bf16."""
    names = []
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        if not (cfg.get("bf16") or {}).get("enabled"):
            continue
        names.append(path.name)
        assert cfg.get("communication_data_type") == "fp32", path
        stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
        accum = (cfg.get("data_types") or {}).get("grad_accum_dtype")
        assert accum == ("fp32" if stage > 0 else None), path
        if stage == 0:
            assert "bf16" in cfg.get("_comment", "") and "grad_accum_dtype" in cfg["_comment"], path
    assert {"zero3_bf16_tp2.json", "zero3_bf16_cp2.json", "zero3_bf16_tp2_cp2.json"} <= set(names)


class _MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matmul-like aten op outside the regions marked by ``inside``."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu")

    def __init__(self):
        super().__init__()
        self.inside, self.seen = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS and not self.inside:
            self.seen.append((name, tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunked", [False, True])
def test_bf16_step_multiplies_in_bf16_outside_attention(chunked, monkeypatch):
    """A bf16 step as DeepSpeed builds it (parameters cast, buffers not): every matmul of forward and backward
    outside the attention and the RoPE tables has bf16 inputs, the teacher head included. Deliberately fp32 inside
    the attention and for the RoPE cos/sin tables (fp32 positions and frequencies: bf16 positions lose precision
    beyond 256): the
    diagonal keys' scores and merge (S·H·K·D work, merged by LSE) and the CPU kernels tiled/sdpa, which accumulate
    in fp32; flex on CUDA runs bf16 with an fp32 LSE."""
    import kernels.ttt_attention as ttt_attention
    from recipe.model.ttt import TTTModel

    draft, head_VH, batch = build_case(0, 3, seq_len=16)
    model = TTTModel(draft, head_VH, loss_chunk_size=5 if chunked else None, checkpoint_steps=chunked,
                     sparse_anchors=False)
    for p in model.parameters():  # DeepSpeed's bf16 cast (engine._cast_module_mixed_precision): parameters only
        p.data = p.data.to(torch.bfloat16)
    assert model.target_head_d.dtype == torch.float32
    mode = _MatmulDtypes()
    attention = model.draft.midlayer.self_attn.causal_attention

    def marked(fn):
        """``fn`` with its forward and its backward (recomputed under autograd) inside the marked region."""
        class Marked(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                ctx.args = args
                mode.inside += 1
                try:
                    return fn(*args)
                finally:
                    mode.inside -= 1

            @staticmethod
            def backward(ctx, *grads):
                mode.inside += 1
                try:
                    with torch.enable_grad():
                        args = [a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                                for a in ctx.args]
                        outs = [o for o, g in zip(fn(*args), grads) if g is not None]
                        torch.autograd.backward(outs, [g for g in grads if g is not None])
                    return tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
                finally:
                    mode.inside -= 1

        return lambda *args: Marked.apply(*args)

    model.draft.midlayer.self_attn.causal_attention = marked(attention)
    rope_forward = model.draft.rotary_emb.forward

    def rope_tables(*args, **kwargs):  # cos/sin in fp32 by design (transformers 5.17 makes them with a matmul)
        mode.inside += 1
        try:
            return rope_forward(*args, **kwargs)
        finally:
            mode.inside -= 1

    monkeypatch.setattr(model.draft.rotary_emb, "forward", rope_tables)
    monkeypatch.setattr(ttt_attention, "diagonal_attention", marked(ttt_attention.diagonal_attention))
    batch.aux_hidden_BSA = batch.aux_hidden_BSA.to(torch.bfloat16)
    batch.target_hidden_BLH = batch.target_hidden_BLH.to(torch.bfloat16)
    with mode:
        out = model(batch)
        out.loss_sum_K.sum().backward()
    assert model.target_head_d.dtype == torch.bfloat16 and out.loss_sum_K.dtype == torch.float32
    assert len(mode.seen) > 20
    assert all(set(dtypes) == {"torch.bfloat16"} for _, dtypes in mode.seen), sorted(set(mode.seen))


def _config(path: Path, bf16: bool) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=1)  # 2 ranks × 2 micro-batches
    cfg["optimizer"]["params"]["lr"] = 1e-3
    cfg.pop("scheduler")  # constant lr: every step moves the weights
    if not bf16:
        cfg.pop("bf16")
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def runs(real_store, tmp_path_factory):
    """fp32 and bf16 ZeRO-3 runs (2 ranks, same seed, data and global batch) on the fp32 store of 24 ShareGPT
    conversations dumped from the real target (``real_store``): fp32 dp2, and bf16 at dp2, tp2 and cp2. Returns
    ({name: metrics}, the bf16 dp2 run folder)."""
    tmp = tmp_path_factory.mktemp("bf16")
    _, flags = real_store

    def argv(name, bf16, *layout):
        return ["--ds_config", str(_config(tmp / f"{name}.json", bf16)), "--output", str(tmp / name), *flags,
                "--max-steps", str(STEPS), *layout]

    plan = {"fp32": argv("fp32", False), "bf16": argv("bf16", True),
            "bf16_tp2": argv("bf16_tp2", True, "--tp-size", "2"), "bf16_cp2": argv("bf16_cp2", True, "--cp-size", "2")}
    metrics = run_ranks(2, run_training, list(plan.values()))[0]
    return dict(zip(plan, metrics)), tmp / "bf16"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bf16", "bf16_tp2", "bf16_cp2"])
def test_bf16_zero3_tracks_fp32_on_the_real_target(runs, layout):
    """bf16 at dp2, tp2 and cp2 against the fp32 dp2 run (the fp32 layouts agree with each other within 1e-5, so
    the differences are bf16's). Tolerances from bf16's 8-bit significand (unit roundoff u = 2^-8 ≈ 3.9e-3).

    Step 1 runs the same weights: only the forward's rounding differs. Each bf16 matmul output carries a relative
    error of order u, so logits (|z| of a few units) and the fp32 soft cross-entropy built from them move by O(u) in
    relative terms: |Δloss| ≤ 2·u·loss. Later steps add the drift of updates computed from bf16 gradients (DeepSpeed
    keeps fp32 master weights and, with these configs, reduces and accumulates gradients in fp32, so updates
    themselves are not rounded away): allowed 4·u relative. Accuracy counts argmax agreements; an O(u) logit
    perturbation flips only near-ties, bounded here by 0.03 absolute (about 9 of the ~300 valid positions of a TTT
    step). Bit-level agreement would mean bf16 was not active, so the runs must differ.
    Measured (torch 2.13 CPU; dp2 / tp2 / cp2): relative loss difference 5.3e-5 / 6.5e-5 / 5.2e-5 at step 1, at most
    7.2e-3 / 7.1e-3 / 7.1e-3 later (largest after the first Adam step, whose update is nearly lr·sign(g) and so
    sensitive to rounding); accuracy differences at most 0.0042 / 0.0042 / 0.0061.
    """
    fp32, bf16 = runs[0]["fp32"], runs[0][layout]
    u = 2.0 ** -8
    assert len(fp32) == len(bf16) == STEPS
    assert fp32[-1]["loss"] < fp32[0]["loss"] and bf16[-1]["loss"] < bf16[0]["loss"]  # both learn
    for a, b in zip(fp32, bf16):
        rtol = 2 * u if a["step"] == 1 else 4 * u
        within(abs(b["loss"] - a["loss"]) / a["loss"], rtol, f"step {a['step']} bf16 loss against fp32")
        assert max(abs(x - y) for x, y in zip(a["acc"], b["acc"])) <= 0.03, (a["step"], a["acc"], b["acc"])
        assert a["valid"] == b["valid"] and a["tokens"] == b["tokens"]
    assert any(a["loss"] != b["loss"] for a, b in zip(fp32, bf16))


@pytest.mark.slow
def test_eval_runs_the_bf16_draft(runs, assets, tmp_path):
    from safetensors import safe_open

    from recipe.eval import __main__ as cli

    export = runs[1] / "export"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16  # a bf16 run exports bf16
    out = tmp_path / "eval.json"
    assert cli.main(["--target", str(assets.target), "--draft", str(export), "--num-draft-tokens", "3",
                     "--max-new-tokens", "8", "--limit", "2", "--output", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["draft_dtypes"] == {str(export): "bfloat16"}  # run in the export's own dtype
    assert result["num_prompts"] == 2 and 1.0 <= result["tau"] <= 4.0
