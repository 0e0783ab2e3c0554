"""The target's head: its input embedding and lm_head read from its folder (without the decoder layers), and the
greedy-token argmax over the full vocabulary in chunks of positions.

The draft needs both tensors (its frozen ``embed_tokens`` and the target's lm_head rows of the draft vocabulary that
turn the target's last hidden state into labels); in offline mode nothing else of the target is needed, and for an
8B target reading 2 of ~300 tensors matters. Parameter names are found by building the model on the meta device, so
any architecture transformers knows (Llama, Qwen, Mistral, Gemma, …) works, tied embeddings included.

Teacher logits (``recipe.model.loss.target_logits``) are what the target's causal LM outputs, restricted to the
rows given: for targets with a final logit soft-cap (``recipe.target.registry``: Gemma 2/3, applied by their
``ForCausalLM.forward`` after ``lm_head``) that is the soft-capped distribution, the one speculative decoding
verifies against, so the draft is trained on it too.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from recipe.target.files import weight_files


def _read(files: dict[str, Path], name: str, folder: Path) -> torch.Tensor:
    if name not in files:
        raise KeyError(f"{folder}: tensor '{name}' not found in the target's safetensors files")
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def _param_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}.weight" if name else "weight"
    raise KeyError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def load_embedding_and_head(folder: Path, dtype: torch.dtype = torch.float32
                            ) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Return ``(embed_VH, lm_head_VH, hf_config)`` of the target in ``folder``.

    embed_VH, lm_head_VH: [V, H_t] in ``dtype`` (the same tensor values when the target ties them).
    Raises FileNotFoundError/KeyError naming the folder when the weights are missing.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a target model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # A tied weight has several names; each module's own attribute path is the one its checkpoint may use.
    embed_name = _param_name(model, model.get_input_embeddings())
    head_name = _param_name(model, model.get_output_embeddings())
    files = weight_files(folder).tensor_files()
    embed = _read(files, embed_name, folder).to(dtype)
    tied = getattr(config, "tie_word_embeddings", False)
    if head_name in files:
        head = _read(files, head_name, folder).to(dtype)
    elif tied:
        head = embed
    else:
        raise KeyError(f"{folder}: lm_head tensor '{head_name}' not found and the config does not tie embeddings")
    return embed, head, config


def validity_rows(loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the rows j whose target argmax some TTT step's validity reads, ``loss_mask[j + 1]`` (False at the
    last position). ``valid[k, p]`` reads ``in_vocab[p+1+k]`` only together with ``loss_mask[p+2+k]``
    (docs/algorithm.md, "Inputs, labels and masks"), so the argmax at any other row is never read."""
    mask = loss_mask_BS.bool()
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


@torch.no_grad()
def lm_head_argmax(last_hidden_BSH: torch.Tensor, lm_head_VH: torch.Tensor, chunk_size: int = 1024,
                   rows_BS: torch.Tensor | None = None) -> torch.Tensor:
    """The target's greedy token per position, ``argmax_v (last_hidden @ lm_head.T)[..., v]``: [B, S] int64 on
    ``lm_head_VH``'s device. ``rows_BS`` ([B, S] bool, best on the CPU: its row list is then taken without a device
    sync): only those rows are computed (``validity_rows``: the ones the TTT validity reads), the others are 0.

    The logits are formed in ``lm_head_VH``'s dtype on its device, ``chunk_size`` positions (of the flattened B·S)
    at a time, so at most ``chunk_size × V`` logits exist at once. A final-logit soft-cap (``tanh(z / c) · c``) is
    monotonic and leaves the argmax unchanged, so it is not applied. Raises ValueError on a non-positive chunk size
    or when the hidden width is not ``H_t`` of the head.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if last_hidden_BSH.shape[-1] != lm_head_VH.shape[1]:
        raise ValueError(f"lm_head_argmax: hidden {tuple(last_hidden_BSH.shape)} does not fit lm_head "
                         f"{tuple(lm_head_VH.shape)}")
    hidden_NH = last_hidden_BSH.reshape(-1, lm_head_VH.shape[1])
    index_M = None
    if rows_BS is not None:
        index_M = torch.nonzero(rows_BS.reshape(-1)).flatten().to(hidden_NH.device)
        hidden_NH = hidden_NH[index_M]
    rows_NH = hidden_NH.to(lm_head_VH.device, lm_head_VH.dtype)
    argmax_N = [(chunk @ lm_head_VH.T).argmax(dim=-1) for chunk in rows_NH.split(chunk_size)]
    argmax_N = torch.cat(argmax_N) if argmax_N else rows_NH.new_zeros(0, dtype=torch.int64)
    if index_M is not None:
        full_N = torch.zeros(last_hidden_BSH.shape[:-1].numel(), dtype=torch.int64, device=argmax_N.device)
        argmax_N = full_N.index_copy_(0, index_M.to(argmax_N.device), argmax_N)
    return argmax_N.view(last_hidden_BSH.shape[:-1])
