"""Our step and SpecForge's, timed in the one child process of ``scripts/gpu_perf_check.py``.

``Bench`` holds what every row shares: the 8B-shaped draft (drawn once from its seed, a random draft vocabulary of
``d2t``/``t2d``; its initial export tensors kept on the host for SpecForge), the frozen target head, our training
model (``recipe.parallel.parallelize.build_training_model``) inside a DeepSpeed engine as ``run.py`` makes it
(``ds_configs/zero1_bf16.json``: ZeRO-1, bf16 with fp32 gradient accumulation, AdamW over fp32 masters, clipping at
0.5) at world size 1 (NCCL on CUDA, gloo on the CPU), and one batch per geometry. Our step is the training loop's:
``engine(batch)``, ``ttt_objective``, ``engine.backward``, ``engine.step`` (optimizer included). A row's switches are
set on the same engine (``TTTModel``'s memory switches are plain attributes; the MLP tiling, the causal-block
attention and the small ops are what ``parallelize`` installs), so every row trains the same parameters.

SpecForge's step (``scripts/gpu_perf_specforge.py``) starts from the same initial weights (built when its first row
runs, from the kept tensors) and reads the same raw batch.
"""
from __future__ import annotations

import gc
import os
import time
import traceback

import torch

from scripts.gpu_perf_rows import LOSS_CHUNK, MLP_TILE, TTT_STEPS, Row, Switches, bench_spec, geometry, row_length

ZERO1_BF16 = "zero1_bf16.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def init_process_group(device_type: str) -> None:
    """One rank of its own (``recipe.lifecycle.distributed.init_distributed``: NCCL on CUDA, gloo on the CPU)."""
    from recipe.lifecycle.distributed import free_port, init_distributed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    init_distributed()


def engine_config(batch: int) -> dict:
    """``ds_configs/zero1_bf16.json`` at one rank with ``batch`` samples per micro-batch and optimizer step, resolved
    as ``run.py`` resolves it (``recipe.config.load_run_config``)."""
    import json
    import tempfile
    from pathlib import Path

    from recipe.config import load_run_config

    from scripts.gpu_perf_rows import ROOT

    cfg = json.loads((ROOT / "ds_configs" / ZERO1_BF16).read_text())
    cfg.update(train_batch_size=batch, train_micro_batch_size_per_gpu=batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ZERO1_BF16
        path.write_text(json.dumps(cfg))
        return load_run_config(path, 1).with_total_steps(1000).deepspeed_config()


class Bench:
    """The shared state of the rows (module docstring). ``smoke``: the CPU's tiny geometry; ``lengths``: the longest
    sample any row runs (the RoPE tables cover it); ``batch``: samples per micro-batch of the engine."""

    def __init__(self, smoke: bool, longest: int, batch: int, first: Switches):
        import deepspeed

        from recipe.config import KernelOptions
        from recipe.export import export_tensors
        from recipe.model.draft import Eagle3Draft
        from recipe.parallel.dims import ParallelDims
        from recipe.parallel.parallelize import build_training_model
        from recipe.parallel.topology import ParallelState
        from recipe.plan.spec import spec_draft_config, spec_memory

        self.smoke, self.device = smoke, torch.device("cpu" if smoke else "cuda")
        self.dtype, self.K, self.shape = torch.bfloat16, TTT_STEPS[smoke], geometry(smoke)
        init_process_group(self.device.type)
        t0 = time.monotonic()
        spec = bench_spec(Row("longest", "ours", longest), smoke, first, self.device.type)
        self.draft_config = spec_draft_config(spec)
        draft = Eagle3Draft(self.draft_config, seed=0)
        g = torch.Generator().manual_seed(1)
        v, vd, ht = self.shape["vocab"], self.shape["draft_vocab"], self.shape["target_hidden"]
        self.draft_ids = torch.randperm(v, generator=g)[:vd].sort().values
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[self.draft_ids] = True
        draft.set_vocab_map(self.draft_ids - torch.arange(vd), t2d)
        self.head_d = torch.randn(vd, ht, generator=g) / ht ** 0.5  # teacher logits of O(1) on O(1) hidden states
        self.rest = torch.randn(v, ht, generator=g) / ht ** 0.5 if smoke else None  # non-draft rows (GPU: zeros)
        # the host copy SpecForge's draft is built from (cloned: export_tensors returns the CPU parameters themselves)
        self.initial = {name: t.clone() for name, t in export_tensors(draft.state_dict()).items()}
        self.embed = draft.embed_tokens.weight.detach().clone()
        memory = spec_memory(spec)  # the first row's switches (every row sets its own: apply)
        pstate = ParallelState(ParallelDims(world_size=1), self.device)
        model = build_training_model(draft, self.head_d.clone(), memory,
                                     KernelOptions(attention="sdpa" if smoke else "flex",
                                                   compile_small_ops=first.compile), pstate, self.device)
        model = model.to(device=self.device, dtype=self.dtype)
        self.engine, *_ = deepspeed.initialize(model=model, config=engine_config(batch), mpu=pstate.mpu(),
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        self.build_s = round(time.monotonic() - t0, 1)
        self.auto_attention = model.draft.get_submodule("midlayer.self_attn").causal_attention
        self.static_flex, self.specforge, self.raw = None, None, None
        self.first_losses = None  # our first step's per-step loss sums, from the initial weights (the loss check)
        self.steps_taken = 0  # our steps so far (the first row warms up once more: it compiles)
        self.specforge_rows = 0  # SpecForge rows run (the first one's first step is the loss check's)

    # ---- switches and batches -----------------------------------------------------------------------------------
    def apply(self, switches: Switches) -> None:
        """Set the row's switches on the engine's model (module docstring)."""
        from recipe.model.small_ops import EAGER_SMALL_OPS, install_small_ops, process_small_ops
        from recipe.parallel.apply_tp import mlp_tiling

        m = self.engine.module
        m.checkpoint_steps, m.teacher_logits_once = switches.checkpoint, switches.teacher_once
        m.loss_chunk_size = LOSS_CHUNK[self.smoke] if switches.chunked else None
        m.draft.get_submodule("midlayer").mlp_tiling = mlp_tiling(MLP_TILE[self.smoke]) if switches.mlp_tiles else None
        attention = self.auto_attention if switches.flex_dynamic else self._static_flex()
        m.draft.get_submodule("midlayer.self_attn").causal_attention = attention
        ops = process_small_ops("aot_eager" if self.smoke else "inductor") if switches.compile else EAGER_SMALL_OPS
        install_small_ops(m, ops)

    def attention_name(self, switches: Switches) -> str:
        """The causal-block kernel a row runs: the ``auto`` one (flex on CUDA, sdpa on the CPU) or static flex."""
        return ("sdpa" if self.smoke else "flex") if switches.flex_dynamic else "flex static shapes"

    def _static_flex(self):
        """Flex with static shapes (``CompiledFlex(dynamic=False)``, a compile per length; the smoke: Dynamo's
        ``aot_eager`` with torch's CPU-backward refusal lifted, as tests/test_flex_compiled.py does)."""
        if self.static_flex is None:
            from kernels.flex_attention import CompiledFlex, FlexCausalAttention

            if self.smoke:
                import torch.nn.attention.flex_attention as torch_flex

                torch_flex._validate_device = lambda *tensors: None
            self.static_flex = FlexCausalAttention(compiled=CompiledFlex(
                dynamic=False, recompile_limit=64, backend="aot_eager" if self.smoke else "inductor"))
        return self.static_flex

    def raw_batch(self, row: Row) -> dict:
        """The geometry's random sample batch on the device (token ids, full supervision, aux and last hidden
        states, the in-vocabulary flags from the full target head), drawn once per geometry."""
        key = (row.batch, row_length(row, self.smoke))
        if self.raw is None or self.raw["key"] != key:
            self.raw = None
            gc.collect()
            b, s = key
            g = torch.Generator(device=self.device).manual_seed(2)
            ht = self.shape["target_hidden"]
            last = torch.randn(b, s, ht, generator=g, device=self.device).to(self.dtype)
            self.raw = {"key": key, "input_ids": torch.randint(0, self.shape["vocab"], (b, s), generator=g,
                                                               device=self.device),
                        "loss_mask": torch.ones(b, s, dtype=torch.bool, device=self.device),
                        "aux": torch.randn(b, s, 3 * ht, generator=g, device=self.device).to(self.dtype),
                        "last_hidden": last, "in_vocab": self._in_vocab(last)}
        return self.raw

    def full_head(self) -> torch.Tensor:
        from scripts.gpu_perf_specforge import full_target_head

        return full_target_head(self.head_d, self.draft_ids, self.shape["vocab"], self.rest).to(self.device, self.dtype)

    def _in_vocab(self, last_BSH: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """``t2d[argmax z]`` of the full target head's logits, ``chunk`` rows at a time (no [B·S, V] table)."""
        head, t2d = self.full_head(), self.engine.module.draft.t2d
        rows = last_BSH.reshape(-1, last_BSH.shape[-1])
        out = torch.cat([t2d[(rows[i:i + chunk] @ head.T).argmax(-1)] for i in range(0, rows.shape[0], chunk)])
        return out.view(last_BSH.shape[:2])

    def ttt_batch(self, raw: dict):
        from recipe.model.ttt import make_ttt_batch

        return make_ttt_batch(raw["input_ids"], raw["loss_mask"], torch.ones_like(raw["loss_mask"]), raw["aux"],
                              raw["last_hidden"], raw["in_vocab"], self.K)

    # ---- steps --------------------------------------------------------------------------------------------------
    def our_step(self, batch) -> torch.Tensor:
        """One training step as ``recipe.train.loop`` runs it (optimizer included); the per-step loss sums."""
        from recipe.model.ttt import ttt_objective

        out = self.engine(batch)
        self.engine.backward(ttt_objective(out, out.valid_K))
        self.engine.step()
        self.steps_taken += 1
        return out.loss_sum_K.detach()

    def time_steps(self, step, warm: int, timed: int) -> dict:
        """Seconds of ``warm`` + ``timed`` calls of ``step()`` (each synchronised): the mean of the timed ones, the
        first one's, and the allocator's peaks since the first; ``losses``: the first call's result."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds, first = [], None
        for _ in range(warm + timed):
            start = time.perf_counter()
            result = step()
            _sync(self.device)
            seconds.append(time.perf_counter() - start)
            first = result if first is None else first
        timed_s = seconds[warm:] or seconds
        out = {"seconds": sum(timed_s) / len(timed_s), "seconds_first": seconds[0], "steps_timed": len(timed_s),
               "losses": first}
        if cuda:
            out.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                       max_memory_reserved=torch.cuda.max_memory_reserved())
        return out

    def specforge_step(self):
        """SpecForge's step on this geometry's raw batch, its draft built from the initial tensors (released again by
        :meth:`release_specforge` after the row: our rows' memory plans do not count it)."""
        import scripts.gpu_perf_specforge as sfa

        if self.specforge is None:
            self.specforge = {"sf": sfa.load_specforge(), "backend": "sdpa" if self.smoke else "flex_attention"}
        if "step" not in self.specforge:
            sf, backend = self.specforge["sf"], self.specforge["backend"]
            draft = sfa.build_draft(sf, self.draft_config, self.initial, self.embed, self.device, self.dtype, backend)
            self.specforge["step"] = sfa.SpecForgeStep(sf, draft, self.full_head(), self.K, backend, eager=self.smoke)
        raw = self.raw
        batch = sfa.specforge_batch(self.specforge["sf"], raw["input_ids"], raw["loss_mask"], raw["aux"],
                                    raw["last_hidden"])
        return lambda: self.specforge["step"].step(batch)["plosses"]

    def release_specforge(self) -> None:
        """Drop SpecForge's draft, optimizer and cached blocks (its module stays imported, its compiles cached)."""
        if self.specforge is not None:
            self.specforge = {"sf": self.specforge["sf"], "backend": self.specforge["backend"]}
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _error_record(exc: BaseException) -> dict:
    if isinstance(exc, torch.OutOfMemoryError):
        return {"status": "oom", "detail": str(exc).splitlines()[0][:500]}
    return {"status": "error", "detail": f"{type(exc).__name__}: {str(exc)[:500]}",
            "traceback": traceback.format_exc()[-2000:]}


def _recover(bench: Bench) -> None:
    """After a failed step: drop gradients and cached blocks so the next row starts clean."""
    bench.engine.zero_grad()
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def run_ours(bench: Bench, row: Row, switches: Switches, warm: int, timed: int) -> dict:
    """Our step (optimizer included) with ``switches``: seconds, speed (``recipe.plan.spec.spec_speed``: positions and
    supervised tokens a second, model and hardware TFLOP/s, MFU), peaks, compile counts."""
    from recipe.model.flops import run_peak_tflops
    from recipe.plan.spec import spec_speed

    spec = bench_spec(row, bench.smoke, switches, bench.device.type)
    try:
        bench.apply(switches)
        batch = bench.ttt_batch(bench.raw_batch(row))
        record = bench.time_steps(lambda: bench.our_step(batch), warm, timed)
        losses = record.pop("losses")
        if bench.first_losses is None:  # the engine's first step: from the initial weights SpecForge starts from
            bench.first_losses = {"geometry": [row.batch, spec.seq_len], "loss_sums": losses.double().cpu()}
        record.update(status="ok", loss_sums_first=[float(x) for x in losses], attention=bench.attention_name(switches),
                      **spec_speed(spec, record["seconds"], run_peak_tflops(bench.device, bench.dtype)))
    except Exception as exc:  # noqa: BLE001 - recorded; the next row still runs
        record = _error_record(exc)
        _recover(bench)
    return record


def run_specforge(bench: Bench, row: Row, warm: int, timed: int) -> dict:
    """SpecForge's step (optimizer included) on the same geometry and batch; speed by our FLOP model (the same model
    FLOPs). Its first step (from the initial weights) on the geometry of our first step (also from them) gives the
    bf16 loss check: its per-step losses in our units beside ours."""
    from recipe.model.flops import run_peak_tflops
    from recipe.plan.spec import spec_speed

    from scripts.gpu_perf_specforge import specforge_loss_sums

    spec = bench_spec(row, bench.smoke, Switches(), bench.device.type)
    try:
        bench.raw_batch(row)
        first_step = bench.specforge_rows == 0
        bench.specforge_rows += 1
        record = bench.time_steps(bench.specforge_step(), warm, timed)
        mapped = specforge_loss_sums(record.pop("losses").float().cpu(), row.batch, spec.seq_len)
        record.update(status="ok", backend=bench.specforge["backend"], version=bench.specforge["sf"].version,
                      loss_stand_in=bench.specforge["sf"].loss_stand_in, loss_sums_first=[float(x) for x in mapped],
                      **spec_speed(spec, record["seconds"], run_peak_tflops(bench.device, bench.dtype)))
        ours = bench.first_losses
        if first_step and ours is not None and ours["geometry"] == [row.batch, spec.seq_len]:
            ours = ours["loss_sums"]
            record["loss_check_bf16"] = {"ours": [float(x) for x in ours],
                                         "max_rel": float(((ours - mapped).abs() / ours.abs()).max())}
    except Exception as exc:  # noqa: BLE001 - recorded; our rows are unaffected
        record = _error_record(exc)
    bench.release_specforge()
    return record
