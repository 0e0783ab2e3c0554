"""The plan of ``python -m recipe.experiments demo-gpu``: its sizes (:class:`Scale`: ``GPU``, and ``TINY``, the same stages
at toy sizes on the CPU), the estimated seconds of each stage (:data:`ESTIMATES_S`), the training steps that fill
the time left by the rest, the evaluation jobs, and the stage deadlines ``--dry-run`` prints.

Every stage has an estimate and a deadline, the sum of the estimates up to it from the demo's start, the last at
most the budget (540 s: one device call of 600 s, less its start and the wheels' install). The training stages get
the seconds the other stages leave: ``short_share`` of them to the short draft, the rest to its warm continuation,
turned into optimizer steps by the FLOP model of one step (``recipe.model.flops.step_flops``, hardware FLOPs with
the memory switches of ``ds_configs/zero1_bf16.json``) at an effective rate (``effective_tflops``). The estimates
are orders of magnitude, not measurements (no GPU has run this demo yet): the JSON of the first GPU run records
every stage's seconds and each arm's seconds per step beside them, which is what to revise them from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from recipe.model.flops import DraftShape, Recompute, TargetShape, step_flops
from recipe.target.registry import draft_config_for

SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, num_hidden_layers=30, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu")
"""The shipped target's geometry (SmolLM2-135M-Instruct, its config.json after ``python -m recipe.assets``): the
plan of a ``--dry-run`` made without the target at hand."""


@dataclass(frozen=True)
class Scale:
    """The demo's sizes. Training: samples of ``short_length`` tokens (``conversations``: the first N of the data
    file, None: all), ``short_batch`` samples a step in micro-batches of ``short_micro``, peak lr ``short_lr``; the
    warm continuation (``run.py --init-draft``) on the first ``warm_conversations`` conversations chained into
    samples of ``warm_length`` tokens (``--chain-conversations``), anchor-offset positions off; ``*_steps``: fixed
    steps, None to fill the budget. Evaluation (``recipe.eval``, both drafts in every process, greedy-checked):
    MT-Bench = the unrelated request at context 0 (``mtbench_prompts``, chain at every k of ``ks`` and the tree),
    the unrelated contrast at the other ``contrast_lengths`` and the requests about an inserted earlier conversation
    at ``context_lengths`` (``context_prompts`` each, chain at the first k, the tree too with ``tree_at_lengths``),
    ``max_new_tokens`` each; every (request, length) split into processes of at most ``chunk_prompts`` prompts,
    ``eval_jobs`` of them at once. ``budget_s``: the seconds the stages are planned into; ``deadline_factor``: the
    deadlines are the summed estimates times this (at most the budget; the tiny scale's fixed steps need no tight
    deadlines, and a shared 2-core machine runs slower than its estimates)."""

    name: str
    short_length: int
    warm_length: int
    ttt_steps: int
    draft_vocab: int
    short_batch: int
    short_micro: int
    short_lr: float
    warm_batch: int
    warm_micro: int
    warm_lr: float
    conversations: int | None
    warm_conversations: int
    short_steps: int | None
    warm_steps: int | None
    ks: tuple[int, ...]
    mtbench_prompts: int
    context_lengths: tuple[int, ...]
    context_prompts: int
    contrast_lengths: tuple[int, ...]
    max_new_tokens: int
    chunk_prompts: int
    eval_jobs: int
    budget_s: int
    tree_at_lengths: bool = False
    short_share: float = 0.7
    deadline_factor: float = 1.0


GPU = Scale("gpu", short_length=2048, warm_length=8192, ttt_steps=7, draft_vocab=32000, short_batch=16,
            short_micro=8, short_lr=1e-3, warm_batch=4, warm_micro=1, warm_lr=2.5e-4, conversations=None,
            warm_conversations=2000, short_steps=None, warm_steps=None, ks=(5, 3), mtbench_prompts=80,
            context_lengths=(256, 2048, 4096, 7168), context_prompts=64, contrast_lengths=(0, 7168),
            max_new_tokens=32, chunk_prompts=64, eval_jobs=8, budget_s=540)
TINY = Scale("tiny", short_length=128, warm_length=256, ttt_steps=2, draft_vocab=256, short_batch=2, short_micro=1,
             short_lr=2e-3, warm_batch=2, warm_micro=1, warm_lr=5e-4, conversations=40, warm_conversations=40,
             short_steps=3, warm_steps=2, ks=(3, 2), mtbench_prompts=2, context_lengths=(64, 128), context_prompts=2,
             contrast_lengths=(0, 128), max_new_tokens=4, chunk_prompts=2, eval_jobs=4, budget_s=600,
             tree_at_lengths=True, deadline_factor=6.0)
SCALES = {"gpu": GPU, "tiny": TINY}

ESTIMATES_S = dict(
    assets=30,            # recipe.assets (a fresh cache converts the GGUF: 23 s of CPU here); 0 with --target
    run_start=25,         # run.py: torch, DeepSpeed, deepspeed.initialize, the 135M target (538 MB fp32) loaded
    data_short=20,        # 121 MB of JSONL read, 17,671 conversations tokenised (7 s / 1000 on one core here,
                          # --num-proc = the cores), the draft vocabulary counted
    data_warm=15,         # the first warm_conversations tokenised, chained and tokenised again at warm_length
    compile=40,           # first step: flex forward + backward and the small ops compiled (gpu_check: 10 s, H200)
    compile_cached=20,    # the warm run's (Inductor's cache on disk; other shapes)
    save_export=10,       # the final checkpoint (24 M parameters + Adam) with its manifest, the export
    stop=15,              # a run stopped at its deadline: its checkpoint, then recipe.export from it
    effective_tflops=100,  # hardware FLOP/s of a step of this 135M target + 1-layer draft (~10 % of a bf16 peak)
    step_overhead=0.05,   # optimizer, logging and launches per step
    short_mean_tokens=1466,  # mean sample at 2048: ShareGPT's first 1000 conversations (964 samples, 44 % cut)
    warm_mean_tokens=7212,   # mean chained sample at 8192: the same 1000 conversations (196 samples)
    eval_start=40,        # a recipe.eval process: imports, target (fp32) + 2 drafts loaded, the drafts' flex compiles
    target_forward=0.008,  # one fp32 target forward at batch 1 (30 layers, launch-bound): a greedy token, a verify
    draft_forward=0.002,  # one draft forward (1 layer, lm_head over 32000) or a tree level
    prefill_per_1k=0.01,  # the prompt's prefill per 1k tokens of context
    tau_chain=2.0, tau_tree=2.4,  # assumed τ: rounds a prompt's new tokens take
    contention=1.5,       # an eval process's slow-down when eval_jobs share the GPU and the cores
    report=5,
    margin=10,            # kept free before the budget's end
)
"""Estimated seconds on one H100 or H200 (orders of magnitude: public figures, the H200 runs of
``scripts/gpu_check.py`` and the CPU timings here; no GPU has run this demo yet)."""
TINY_ESTIMATES_S = dict(ESTIMATES_S, assets=5, run_start=15, data_short=3, data_warm=3, compile=5, compile_cached=5,
                        save_export=3, eval_start=10, target_forward=0.02, draft_forward=0.01, contention=2.0)
"""The tiny scale on 2 CPU cores (its steps are fixed: the budget only bounds the deadlines)."""


@dataclass(frozen=True)
class EvalJob:
    """One ``recipe.eval`` process: ``request`` at context ``length``, prompts ``start`` .. ``start + count`` of the
    spread MT-Bench file, chain drafting at ``ks``, tree drafting when ``tree``, ``--seed seed`` (the chunk's own
    draws of inserted context); ``chunk`` of ``chunks`` of its (request, length)."""

    request: str
    length: int
    start: int
    count: int
    ks: tuple[int, ...]
    tree: bool
    seed: int
    chunk: int
    chunks: int

    @property
    def name(self) -> str:
        kind = "about" if self.request == "about-context" else "unrelated"
        return f"{kind}-L{self.length}-c{self.chunk}"


def eval_jobs(scale: Scale) -> list[EvalJob]:
    """Every evaluation process of the demo, the longest first (module docstring, :class:`Scale`)."""
    mtbench = ("unrelated", 0, scale.mtbench_prompts, scale.ks, True)
    others = [("unrelated", n, scale.context_prompts, scale.ks[:1], scale.tree_at_lengths)
              for n in scale.contrast_lengths if n]
    others += [("about-context", n, scale.context_prompts, scale.ks[:1], scale.tree_at_lengths)
               for n in scale.context_lengths]
    jobs = []
    for request, length, prompts, ks, tree in ([mtbench] if 0 in scale.contrast_lengths else []) + others:
        chunks = max(1, math.ceil(prompts / scale.chunk_prompts))
        bounds = [round(i * prompts / chunks) for i in range(chunks + 1)]
        jobs += [EvalJob(request, length, bounds[c], bounds[c + 1] - bounds[c], ks, tree, c, c, chunks)
                 for c in range(chunks)]
    est = ESTIMATES_S
    return sorted(jobs, key=lambda j: -eval_job_seconds(j, scale, est))


def eval_job_seconds(job: EvalJob, scale: Scale, est: dict, drafts: int = 2) -> float:
    """A job's seconds alone on the device: the process's start, then per prompt its prefill, the greedy reference
    and, per draft, chain decoding at each k and tree decoding (depth 5) in rounds of the assumed τ."""
    n, t, d = scale.max_new_tokens, est["target_forward"], est["draft_forward"]
    chain = sum(n / est["tau_chain"] * (k * d + t) for k in job.ks)
    tree = n / est["tau_tree"] * (5 * d + t) if job.tree else 0.0
    per_prompt = job.length / 1024 * est["prefill_per_1k"] + n * t + drafts * (chain + tree)
    return est["eval_start"] + job.count * per_prompt


def eval_seconds(scale: Scale, est: dict) -> float:
    """The evaluation stage's wall time: the jobs on ``eval_jobs`` slots, longest first (each to the slot free
    first), each slowed by ``contention``."""
    slots = [0.0] * max(1, scale.eval_jobs)
    for job in eval_jobs(scale):
        slots[slots.index(min(slots))] += eval_job_seconds(job, scale, est) * est["contention"]
    return max(slots)


def step_seconds(scale: Scale, arm: str, est: dict, target: dict | None = None) -> float:
    """Estimated seconds of one optimizer step of ``arm`` (short or warm): its hardware FLOPs on ``batch`` samples of
    the mean length, the target's forward included, at ``effective_tflops``, plus ``step_overhead``."""
    config = target or SMOLLM2
    vocab = min(scale.draft_vocab, int(config["vocab_size"]))
    shape = DraftShape.of_config(draft_config_for(config, vocab, {"aux_layer_ids": [0, 1, 2]}), scale.ttt_steps)
    mean = est["short_mean_tokens"] if arm == "short" else est["warm_mean_tokens"]
    length = min(mean, scale.short_length if arm == "short" else scale.warm_length)
    batch = scale.short_batch if arm == "short" else scale.warm_batch
    recompute = Recompute(checkpoint_steps=True, chunked_loss=True, teacher_once=True, attention_backward=2.5)
    flops = step_flops(shape, [int(length)] * batch, recompute, target=TargetShape.of_config(SimpleNamespace(**config)))
    return flops.hardware_total / (est["effective_tflops"] * 1e12) + est["step_overhead"]


def fixed_seconds(scale: Scale, est: dict, with_assets: bool) -> dict[str, dict[str, float]]:
    """Each stage's estimate without the training steps (stage -> its terms)."""
    return {"assets": {"assets": est["assets"] if with_assets else 0.0},
            "short": {"run_start": est["run_start"], "data": est["data_short"], "compile": est["compile"],
                      "save_export": est["save_export"]},
            "warm": {"run_start": est["run_start"], "data": est["data_warm"], "compile": est["compile_cached"],
                     "save_export": est["save_export"]},
            "eval": {"jobs": eval_seconds(scale, est)}, "report": {"report": est["report"]}}


def plan(scale: Scale, budget_s: float | None = None, with_assets: bool = True, target: dict | None = None,
         est: dict | None = None) -> dict:
    """The stage plan: ``{"budget_s", "stages": {stage: {"terms", "seconds", "deadline"}}, "steps": {arm: n},
    "step_seconds": {arm: s}, "jobs": [EvalJob], "fits": bool}``. Training steps fill what the other stages leave
    of ``budget_s`` (default the scale's) less ``margin`` (at least 5 each), or are the scale's fixed steps."""
    est = est or (TINY_ESTIMATES_S if scale.name == "tiny" else ESTIMATES_S)
    budget = float(scale.budget_s if budget_s is None else budget_s)
    stages = fixed_seconds(scale, est, with_assets)
    per_step = {arm: step_seconds(scale, arm, est, target) for arm in ("short", "warm")}
    spare = budget - est["margin"] - sum(sum(t.values()) for t in stages.values())
    shares = {"short": scale.short_share, "warm": 1.0 - scale.short_share}
    fixed = {"short": scale.short_steps, "warm": scale.warm_steps}
    steps = {arm: fixed[arm] or max(5, int(max(spare, 0.0) * shares[arm] / per_step[arm])) for arm in shares}
    for arm in shares:
        stages[arm]["steps"] = steps[arm] * per_step[arm]
    out, total = {}, 0.0
    for name, terms in stages.items():
        total += sum(terms.values())
        out[name] = {"terms": terms, "seconds": sum(terms.values()),
                     "deadline": min(total * scale.deadline_factor, budget)}
    return {"budget_s": budget, "stages": out, "steps": steps, "step_seconds": per_step, "jobs": eval_jobs(scale),
            "fits": total <= budget, "estimates_s": est}


def plan_lines(p: dict, scale: Scale) -> list[str]:
    """The plan as ``--dry-run`` prints it: per stage its estimate, deadline and terms; the eval jobs."""
    lines = [f"demo-gpu plan (scale {scale.name}, budget {p['budget_s']:.0f} s; estimates, not measurements)"]
    detail = {"short": f"{p['steps']['short']} steps of {scale.short_batch} samples ≤ {scale.short_length} tokens, "
                       f"{p['step_seconds']['short']:.2f} s each",
              "warm": f"{p['steps']['warm']} steps of {scale.warm_batch} chained samples ≤ {scale.warm_length} "
                      f"tokens, {p['step_seconds']['warm']:.2f} s each",
              "eval": f"{len(p['jobs'])} recipe.eval processes, {scale.eval_jobs} at once"}
    for name, s in p["stages"].items():
        terms = " + ".join(f"{k} {v:.0f}" for k, v in s["terms"].items())
        lines.append(f"{name:<8} est {s['seconds']:>5.0f} s  deadline {s['deadline']:>5.0f} s  [{terms}]"
                     + (f"  {detail[name]}" if name in detail else ""))
    for job in p["jobs"]:
        lines.append(f"  {job.name:<22} {job.count:>3} prompts, k {','.join(map(str, job.ks))}"
                     f"{' + tree' if job.tree else ''}, "
                     f"{scale.max_new_tokens} new tokens, est {eval_job_seconds(job, scale, p['estimates_s']):.0f} s")
    total = sum(s["seconds"] for s in p["stages"].values())
    lines.append(f"{'total':<8} est {total:>5.0f} s  (budget {p['budget_s']:.0f} s"
                 + ("" if p["fits"] else "; DOES NOT FIT: fewer prompts or a larger budget") + ")")
    return lines
