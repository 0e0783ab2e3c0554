"""The tiny test target loaded in fp32 on the CPU with a seeded draft on its embeddings (draft vocabulary 64), for
the evaluation tests."""
from __future__ import annotations

import torch

from recipe.model.draft import Eagle3Draft
from recipe.target.capture import TargetModel
from recipe.target.registry import draft_config_for


def target_and_draft(target_dir) -> tuple[TargetModel, Eagle3Draft]:
    target = TargetModel(target_dir, dtype=torch.float32, device="cpu")
    draft = Eagle3Draft(draft_config_for(target.config, 64), seed=1)
    draft.load_target_embeddings(target.embed_tokens_weight)
    return target, draft
