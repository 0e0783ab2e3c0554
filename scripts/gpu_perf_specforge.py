"""SpecForge's own EAGLE-3 draft step, driven in this process at our geometry, for ``scripts/gpu_perf_check.py``.

Nothing of SpecForge is in this repository: its wheel (``specforge-0.2.0-py3-none-any.whl``, from the package
registry, installed ``--no-deps`` by the device call like the other carried wheels) is imported here, and this module
is our adapter around it. What runs is SpecForge's code: its draft ``LlamaForCausalLMEagle3``
(``specforge.modeling.draft.llama3_eagle``), its TTT unroll ``OnlineEagle3Model`` (``specforge.algorithms.eagle3.
model``: per step the backbone, ``compute_logits``, its Triton soft cross-entropy ``LogSoftmaxLoss`` and the
shift of the inputs and masks), its offline training step ``Eagle3TrainStrategy.forward_loss`` (the frozen target
head over the whole vocabulary, ``0.8^k`` step weights) and its optimizer ``BF16Optimizer`` (fp32 masters, AdamW,
clipping at 0.5, its warm-up schedule). Its defaults are kept: attention ``flex_attention`` (our ``flex``
counterpart; ``sdpa``, its eager path, where flex has no backward: the CPU), no compact teacher (the full-vocabulary
target logits), no FSDP wrapper (at one GPU it shards nothing). SpecForge's own ``torch.compile`` decorators (norm,
RoPE, the teacher's softmax, flex) compile as they do in SpecForge; ``--smoke`` on the CPU runs them eagerly
(``torch.compiler.set_stance("force_eager")``: Inductor's C++ build would dominate a tiny step).

Imports. Only the modules the step needs are imported; in SpecForge 0.2.0 they need torch, transformers, accelerate,
huggingface-hub and safetensors (all in the device image) and, for the loss, ``triton`` (with CUDA's torch). Where
its Triton kernel cannot run (no CUDA device, or no ``triton``: the CPU), ``specforge.core.loss`` is replaced in
``sys.modules`` by a stand-in module
whose ``LogSoftmaxLoss`` computes SpecForge's reference of that kernel (its ``_compute_loss``: ``-Σ mask·Σ_v p·log
softmax(logits)``, averaged over all B·T rows) with autograd: the same function, so the CPU parity check holds.

Same draft, same inputs (:func:`build_draft`, :func:`full_target_head`, :func:`specforge_batch`): SpecForge's
draft is built from our draft's config and loaded with our draft's initial tensors by the shared export names
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``/``t2d``; its frozen ``embed_tokens`` from ours). Its
target head is the full-vocabulary one [V, H_t] whose draft-id rows are ours (the rest zeros, or as given). It
reads the raw sample (token ids, aux hidden states, the target's last hidden states), as its offline data provides
them, and shifts them itself (``TargetHead.preprocess``).

Conventions (docs/algorithm.md, "Where we differ from the public implementations"): SpecForge averages each step's
loss over all B·S rows where we divide by the valid ones, and gates anchor p at step k with the loss mask of token
p+k where our label-aligned mask reads token p+2+k. :func:`mapped_loss_mask` gives SpecForge the mask that selects
our valid anchors (its ``m[j] = ours[j+2]``, 0 on the last two positions); then SpecForge's step-k loss times B·S
equals our ``loss_sum_K[k]`` (:func:`specforge_loss_sums`), and the gradient of its objective equals that of ours
with each step divided by B·S instead of N_k.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

WHEEL = "specforge-0.2.0-py3-none-any.whl"
"""The carried wheel (``bash scripts/gpu_wheels.sh`` downloads it ``--no-deps``)."""
MODULES = {"draft": "specforge.modeling.draft.llama3_eagle", "model": "specforge.algorithms.eagle3.model",
           "strategy": "specforge.training.strategies.base", "optimizer": "specforge.optimizer",
           "contracts": "specforge.runtime.contracts", "target_head": "specforge.modeling.target.target_head"}
LOSS_MODULE = "specforge.core.loss"
STEP_DECAY = 0.8  # SpecForge's ploss_decay, our STEP_DECAY
LR, MAX_GRAD_NORM = 1e-4, 0.5  # SpecForge's training defaults (config.schema)


def reference_log_softmax_loss(logits_BTV, target_BTV, position_mask_BT1):
    """SpecForge's soft cross-entropy as its reference ``_compute_loss`` defines it (the Triton ``LogSoftmaxLoss``
    computes the same): ``-Σ_rows mask·Σ_v target·log_softmax(logits)`` over the B·T rows, divided by B·T;
    fp32."""
    logp = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(position_mask_BT1.squeeze(-1) * (target_BTV * logp).sum(-1)).mean()


def _loss_stand_in() -> types.ModuleType:
    module = types.ModuleType(LOSS_MODULE)
    module.__doc__ = "Stand-in for SpecForge's Triton soft cross-entropy (scripts/gpu_perf_specforge.py)."
    module.LogSoftmaxLoss = types.SimpleNamespace(apply=reference_log_softmax_loss)
    module.STAND_IN = True
    return module


def load_specforge() -> types.SimpleNamespace:
    """Import the SpecForge modules the step needs (``MODULES``), with the loss stand-in where its Triton kernel
    cannot run (no CUDA device or no ``triton``). Returns a namespace of them plus ``loss_stand_in`` (bool) and
    ``version``. Raises ImportError naming the module when SpecForge (or one of its imports) is missing."""
    stand_in = importlib.util.find_spec("triton") is None or not torch.cuda.is_available()
    if stand_in and LOSS_MODULE not in sys.modules:
        importlib.import_module("specforge.core")  # the package; its loss module is the stand-in
        sys.modules[LOSS_MODULE] = _loss_stand_in()
    loaded = {}
    for key, name in MODULES.items():
        try:
            loaded[key] = importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"SpecForge module {name} did not import ({exc}); is {WHEEL} installed?") from exc
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("specforge")
    except PackageNotFoundError:
        found = None
    return types.SimpleNamespace(**loaded, loss_stand_in=stand_in, version=found)


def specforge_config(draft_config):
    """SpecForge's draft config (transformers' ``LlamaConfig``) from our ``Eagle3DraftConfig`` (its HF dict: the
    config our export writes, which SpecForge's loader reads)."""
    from transformers import LlamaConfig  # import cost: transformers' Llama config

    hf = dict(draft_config.to_hf_dict())
    hf.pop("architectures", None)
    return LlamaConfig(**hf)


def build_draft(sf, draft_config, tensors: dict, embed_VH: torch.Tensor, device, dtype, backend: str):
    """SpecForge's ``LlamaForCausalLMEagle3`` on ``device`` in ``dtype`` with attention ``backend``
    ("flex_attention" or "sdpa"), loaded from ``tensors`` (our export names) and ``embed_VH`` (frozen). Raises
    KeyError naming any tensor the two drafts do not share."""
    with torch.device(device):
        draft = sf.draft.LlamaForCausalLMEagle3(specforge_config(draft_config), attention_backend=backend)
    state = {**tensors, "embed_tokens.weight": embed_VH}
    theirs = set(draft.state_dict())
    if set(state) != theirs:
        raise KeyError(f"SpecForge's draft and ours differ: only theirs {sorted(theirs - set(state))}, only ours "
                       f"{sorted(set(state) - theirs)}")
    draft.load_state_dict({k: v.to(device) for k, v in state.items()})
    draft.freeze_embedding()
    return draft.to(device=device, dtype=dtype)


def full_target_head(head_d_VdH: torch.Tensor, draft_ids: torch.Tensor, vocab: int,
                     rest_VH: torch.Tensor | None = None) -> torch.Tensor:
    """The target head over the whole vocabulary [V, H_t] that SpecForge projects: rows ``draft_ids`` are our
    ``head_d_VdH`` (the rows our step reads), the others ``rest_VH``'s (None: zeros, so a logit of 0 there: with
    Vd random logits the greedy token is then a draft token, as our measured batches assume)."""
    full = torch.zeros(vocab, head_d_VdH.shape[1], dtype=head_d_VdH.dtype, device=head_d_VdH.device)
    if rest_VH is not None:
        full.copy_(rest_VH)
    full[draft_ids.to(full.device)] = head_d_VdH
    return full


def mapped_loss_mask(loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """SpecForge's loss mask that selects our valid anchors (module docstring): ``m[:, j] = ours[:, j+2]`` for
    j < S-2, 0 at the last two positions; int64 like SpecForge's data."""
    out = torch.zeros_like(loss_mask_BS, dtype=torch.int64)
    out[:, :-2] = loss_mask_BS[:, 2:].to(torch.int64)
    return out


def specforge_batch(sf, input_ids_BS, loss_mask_BS, aux_BSA, last_hidden_BSH):
    """SpecForge's ``TrainBatch`` of one raw sample batch (offline, ``target_repr="hidden_state"``), our loss mask
    mapped (:func:`mapped_loss_mask`); the tensors on their device as given."""
    tensors = {"input_ids": input_ids_BS, "attention_mask": torch.ones_like(input_ids_BS),
               "loss_mask": mapped_loss_mask(loss_mask_BS), "hidden_state": aux_BSA, "target": last_hidden_BSH}
    return sf.contracts.TrainBatch(sample_ids=[str(i) for i in range(input_ids_BS.shape[0])], strategy="eagle3",
                                   tensors=tensors, metadata={"target_repr": "hidden_state"})


def _target_head(sf, head_VH: torch.Tensor) -> nn.Module:
    """SpecForge's ``TargetHead`` holding ``head_VH`` (its ``from_pretrained`` reads a model folder; here the weights
    are given), frozen; its own ``preprocess`` (the shift) and ``forward``."""
    cls = sf.target_head.TargetHead
    head = cls.__new__(cls)
    nn.Module.__init__(head)
    head.hidden_size, head.vocab_size = head_VH.shape[1], head_VH.shape[0]
    head.fc = nn.Linear(head_VH.shape[1], head_VH.shape[0], bias=False, device=head_VH.device, dtype=head_VH.dtype)
    with torch.no_grad():
        head.fc.weight.copy_(head_VH)
    head.fc.weight.requires_grad_(False)
    return head.eval()


@dataclass
class SpecForgeStep:
    """SpecForge's training step on one device: its ``OnlineEagle3Model`` around ``draft``, its offline
    ``Eagle3TrainStrategy`` with the frozen target head ``head_VH`` [V, H_t], and (``optimizer=True``) its
    ``BF16Optimizer`` (fp32 masters and AdamW; made on the first :meth:`step`). ``eager``: run SpecForge's
    ``torch.compile`` decorators eagerly (the CPU smoke)."""

    sf: types.SimpleNamespace
    draft: nn.Module
    head_VH: torch.Tensor
    ttt_steps: int
    backend: str
    eager: bool = False
    total_steps: int = 1000

    def __post_init__(self):
        self.model = self.sf.model.OnlineEagle3Model(self.draft, length=self.ttt_steps, attention_backend=self.backend)
        head = _target_head(self.sf, self.head_VH)
        self.strategy = self.sf.strategy.Eagle3TrainStrategy(self.model, target_head=head, ploss_decay=STEP_DECAY)
        self.optimizer = None

    def _stance(self):
        return torch.compiler.set_stance("force_eager") if self.eager else nullcontext()

    def forward(self, batch):
        """SpecForge's ``forward_loss`` of ``batch``: its ``StepOutput`` (``loss``; ``metrics["plosses"]``)."""
        with self._stance():
            return self.strategy.forward_loss(batch)

    def step(self, batch) -> dict:
        """Forward, backward and the optimizer step; ``{"loss", "plosses"}`` (floats, read after the step)."""
        if self.optimizer is None:
            self.optimizer = self.sf.optimizer.BF16Optimizer(self.model, lr=LR, max_grad_norm=MAX_GRAD_NORM,
                                                             total_steps=self.total_steps)
        with self._stance():
            out = self.strategy.forward_loss(batch)
            out.loss.backward()
            self.optimizer.step()
        return {"loss": out.loss.detach(), "plosses": torch.stack([p.detach() for p in out.metrics["plosses"]])}


def specforge_loss_sums(plosses_K: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """SpecForge's per-step losses in our units: each is a mean over the B·S rows, so ×B·S is the sum over the valid
    anchors, our ``loss_sum_K`` (module docstring)."""
    return plosses_K.double() * (batch * seq_len)


def estimate_bytes(batch: int, seq_len: int, ttt_steps: int, hidden: int, intermediate: int, draft_vocab: int,
                   vocab: int, trainable: int, weights: int) -> int:
    """A lower bound of SpecForge's bf16 step peak at one GPU (bytes), to skip a length it cannot hold instead of
    running into the allocator: weights (2 B each) and BF16Optimizer's fp32 masters, Adam moments and fp32 grads
    (16 B per trainable), the teacher (full-vocabulary logits [N, V] in bf16 and their fp32 copy, then target_p and
    target_p_on_draft [N, Vd] fp32), per TTT step the contiguous target slice the loss saves ([N, Vd] fp32), its
    bf16 logits, and the layer's saved activations (MLP 3·I and attention/norm ~10·H values in bf16); N = B·S."""
    n = batch * seq_len
    teacher = n * vocab * (2 + 4) + 2 * n * draft_vocab * 4
    per_step = n * draft_vocab * (4 + 2) + n * (3 * intermediate + 10 * hidden) * 2
    return 2 * weights + 16 * trainable + teacher + ttt_steps * per_step
