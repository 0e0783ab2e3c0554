"""A frozen target whose weights are partitioned over all ranks of the job with DeepSpeed ZeRO-3 (ZeRO-Inference), for
targets that do not fit one device (a 70B target is 140 GB in bf16).

Loading (DeepSpeed 0.19.8, transformers 5.23): ``from_pretrained`` runs with transformers' ZeRO-3 integration
(``transformers.integrations.HfDeepSpeedConfig``, set only for the call and unset after): the model is built inside
``deepspeed.zero.Init`` over the world group, so each parameter is partitioned as soon as its module exists and no
rank ever holds the whole model, then the checkpoint is copied in module by module (rank 0 reads the safetensors
files; each module's parameters are gathered, filled and re-partitioned, ``_load_state_dict_into_zero3_model``).
The decoder is then handed to ``deepspeed.initialize`` without an optimizer, whose ZeRO-3 stage registers the
hooks that all-gather each layer's weights just before the layer runs and free them after
(``deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload``). The lm_head (outside the decoder, or tied to its
embedding) is gathered whole for the argmax of each capture (:meth:`PartitionedTargetModel.full_lm_head`).

Every rank runs the forward on its own inputs, but each layer's all-gather is a collective over the world: **every
rank must call** :meth:`~recipe.target.capture.TargetModel.capture` **the same number of times**, in the same order.
The training loop does (each rank builds ``gradient_accumulation_steps`` micro-batches per optimizer step, one
capture each, for the same number of steps); ``recipe.dump`` pads the ranks with fewer batches with one-token
forwards. Memory per rank: ``P · bytes / world`` of weights plus the largest gathered layer(s) (up to DeepSpeed's
``stage3_max_live_parameters``) plus the whole lm_head during the argmax.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from recipe.target.capture import TargetModel, target_fingerprint
from recipe.target.options import TargetOptions


class PartitionedTargetModel(TargetModel):
    """A ``TargetModel`` with its weights ZeRO-3 partitioned over the world (module docstring); ``capture`` has the
    same signature and results, and is a collective.

    Args: as ``TargetModel``, plus ``options``: the ``target`` section (its ``zero_optimization`` settings; default
    DeepSpeed's). Needs ``torch.distributed`` initialised; on CUDA ``device`` must be the current CUDA device (where
    DeepSpeed places the partitions). Raises RuntimeError without a process group, ValueError for a GGUF target
    (convert it to a safetensors folder) or another CUDA device.
    Attributes: ``engine``: the decoder's DeepSpeed engine (``engine.module is self.decoder``).
    """

    partitioned = True

    def __init__(self, path: str | Path, aux_layer_ids=None, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, options: TargetOptions | None = None):
        self.options = options if options is not None else TargetOptions(partition="zero3")
        super().__init__(path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device)

    def _load_model(self, folder: str, kwargs: dict) -> torch.nn.Module:
        # import cost: DeepSpeed and transformers' integration of it, for a partitioned target only
        import deepspeed
        from deepspeed.utils import groups
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        if kwargs:
            raise ValueError(f"{self.path}: a GGUF target cannot be ZeRO-3 partitioned; save it as a Hugging Face "
                             "safetensors folder (AutoModelForCausalLM.from_pretrained(...).save_pretrained(DIR))")
        if not dist.is_initialized():
            raise RuntimeError("a partitioned target needs torch.distributed initialised (launch with deepspeed or "
                               "torchrun)")
        if self.device.type == "cuda" and self.device != torch.device("cuda", torch.cuda.current_device()):
            raise ValueError(f"partitioned target on {self.device}, but the current CUDA device is "
                             f"cuda:{torch.cuda.current_device()} (call torch.cuda.set_device first)")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a partitioned target is held in float32 or bfloat16, not {self.dtype}")
        ds_config = self.options.deepspeed_config(bf16=self.dtype == torch.bfloat16)
        hf_ds_config = HfDeepSpeedConfig(ds_config)  # transformers reads it through a weak reference while alive
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype)
        finally:
            unset_hf_deepspeed_config()
            del hf_ds_config
        model.requires_grad_(False)
        # An engine without an mpu asks deepspeed.utils.groups for its groups, which answer from the mpu the last
        # engine with one registered there (a draft engine built earlier in this process, of another layout).
        # Cleared for this call, the target's engine spans the world like its partitions; restored after.
        registered, groups.mpu = groups.mpu, None
        try:
            self.engine, _, _, _ = deepspeed.initialize(model=model.get_decoder(), config=ds_config)
        finally:
            groups.mpu = registered
        return model

    @property
    def lm_head_weight(self) -> torch.Tensor:
        raise RuntimeError("a partitioned target holds 1/world of its lm_head: use `with target.full_lm_head() as "
                           "head_VH` (a collective)")

    @property
    def embed_tokens_weight(self) -> torch.Tensor:
        raise RuntimeError("a partitioned target holds 1/world of its embedding; read it from the folder "
                           "(recipe.target.head.load_embedding_and_head)")

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.ds_shape[0])

    @property
    def fingerprint(self) -> str:
        """``target_fingerprint`` of the folder (read from its files: no collective)."""
        if self._fingerprint is None:
            self._fingerprint = target_fingerprint(self.path)
        return self._fingerprint

    @contextmanager
    def full_lm_head(self):
        """The whole [V, H_t] lm_head, all-gathered for the block and re-partitioned after (a collective)."""
        import deepspeed  # import cost: deepspeed

        weight = self.model.get_output_embeddings().weight
        with deepspeed.zero.GatheredParameters([weight]):
            yield weight

    def idle_capture(self) -> None:
        """One forward on a single token, its result dropped: a rank with no batch left calls it so that the ranks
        still working can gather their layers (the capture collectives must match)."""
        self.capture(torch.zeros(1, 1, dtype=torch.long))


def build_target(path: str | Path, options: TargetOptions | None, aux_layer_ids=None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> TargetModel:
    """The target the ``target`` section asks for: a ``PartitionedTargetModel`` with ``partition: "zero3"``, else a
    replicated ``TargetModel`` (arguments as ``TargetModel``)."""
    if options is not None and options.partitioned:
        return PartitionedTargetModel(path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device, options=options)
    return TargetModel(path, aux_layer_ids=aux_layer_ids, dtype=dtype, device=device)
