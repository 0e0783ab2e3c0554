"""The draft export folder that SGLang and vLLM load, and its checker (docs/algorithm.md, "Export format").

    python -m recipe.export CHECKPOINT_DIR OUT_DIR    # from a training checkpoint (any ZeRO stage / TP layout)
    python -m recipe.export --check EXPORT_DIR        # reload an export and verify keys, shapes, dtypes, config

An export holds ``config.json`` (``LlamaForCausalLMEagle3``, with ``torch_dtype``: the dtype the floating-point tensors
are saved in) and ``model.safetensors`` with full (unsharded) tensors: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (int64), ``t2d`` (bool); no embeddings.
Both files are written into a temporary folder that is renamed into place, so a reader never sees half an export.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from recipe.io_errors import WriteError, writing

CONFIG_FILE = "config.json"
# A checkpoint folder (written by recipe.lifecycle.checkpoint) holds the full draft that an export is made from:
LATEST = "latest"  # the checkpoints folder's marker naming the newest complete checkpoint
DRAFT_FILE = "draft.safetensors"  # the full draft (ZeRO-gathered, TP-consolidated)
DRAFT_CONFIG_FILE = "draft_config.json"  # its export config.json
WEIGHTS_FILE = "model.safetensors"

REQUIRED_CONFIG = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "num_hidden_layers", "vocab_size", "draft_vocab_size", "rms_norm_eps",
                   "max_position_embeddings", "eagle_config")


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape implied by an export ``config.json`` dict."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    ht = cfg.get("target_hidden_size") or h
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return {
        "fc.weight": (h, n_aux * ht),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
        "d2t": (cfg["draft_vocab_size"],),
        "t2d": (cfg["vocab_size"],),
    }


def export_tensors(draft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pick the export tensors out of a full draft state dict (drops the embedding, see
    ``recipe.model.draft.is_exported``, and any ``draft.`` prefix); CPU, contiguous, d2t int64, t2d bool."""
    from recipe.model.draft import is_exported  # import cost: pulls in transformers

    out = {}
    for name, tensor in draft_state.items():
        if is_exported(name):
            out[name.removeprefix("draft.")] = tensor.detach().to("cpu").contiguous()
    out["d2t"] = out["d2t"].to(torch.int64)
    out["t2d"] = out["t2d"].to(torch.bool)
    return out


def _replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def weights_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    """The ``torch_dtype`` name ("float32", "bfloat16", ...) of the floating-point tensors; None when there are none.
    Raises ValueError naming the dtypes when they are mixed."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    if len(dtypes) > 1:
        raise ValueError(f"refusing to write an export with mixed floating-point dtypes {dtypes}")
    return dtypes[0] if dtypes else None


def write_export(tensors: dict[str, torch.Tensor], config: dict, out_dir: Path) -> Path:
    """Write ``config.json`` (``config`` plus ``torch_dtype`` of the tensors, :func:`weights_dtype`) +
    ``model.safetensors`` atomically (temp folder, then rename). Returns ``out_dir``.

    Raises ValueError listing every problem when the tensors don't match the config (see ``check_tensors``), and
    ``recipe.io_errors.WriteError`` naming the file and the cause when it cannot be written (an existing export
    at ``out_dir`` is then untouched).
    """
    config = {**config, "torch_dtype": weights_dtype(tensors)}
    problems = check_tensors(tensors, config)
    if problems:
        raise ValueError("refusing to write a broken export:\n  " + "\n  ".join(problems))
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:
        with writing(tmp):
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        with writing(tmp / WEIGHTS_FILE):
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        with writing(tmp / CONFIG_FILE):
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        with writing(out_dir):
            _replace_dir(tmp, out_dir)
    except WriteError:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space of a half-written export
        raise
    return out_dir


def check_tensors(tensors: dict[str, torch.Tensor], cfg: dict, weights: str = WEIGHTS_FILE) -> list[str]:
    """Every problem of a tensor dict against an export config, one message each (empty list: fine); a tensor's
    message names ``weights``, the file the tensors came from (an export's ``model.safetensors`` by default)."""
    problems = [f"config.json: missing field '{k}'" for k in REQUIRED_CONFIG if k not in cfg]
    if problems:
        return problems
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"config.json: architectures is {cfg.get('architectures')}, expected "
                        "['LlamaForCausalLMEagle3']")
    if cfg.get("num_hidden_layers") != 1:
        problems.append(f"config.json: num_hidden_layers is {cfg.get('num_hidden_layers')}, expected 1")
    ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids") if isinstance(cfg["eagle_config"], dict) else None
    if not ids or not all(isinstance(i, int) for i in ids):
        problems.append("config.json: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of layer ids")
        return problems
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        if name not in tensors:
            problems.append(f"{weights}: missing tensor '{name}'")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{weights}: '{name}' has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name in sorted(set(tensors) - set(shapes)):
        problems.append(f"{weights}: unexpected tensor '{name}'")
    if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
        problems.append(f"{weights}: 'd2t' has dtype {tensors['d2t'].dtype}, expected torch.int64")
    if "t2d" in tensors and tensors["t2d"].dtype != torch.bool:
        problems.append(f"{weights}: 't2d' has dtype {tensors['t2d'].dtype}, expected torch.bool")
    dtype = cfg.get("torch_dtype")
    for name, t in tensors.items():
        if dtype is not None and t.is_floating_point() and str(t.dtype).removeprefix("torch.") != dtype:
            problems.append(f"{weights}: '{name}' has dtype {t.dtype}, config.json says torch_dtype {dtype!r}")
        if name not in ("d2t", "t2d") and t.is_floating_point() and not torch.isfinite(t).all():
            problems.append(f"{weights}: '{name}' has non-finite values")
    if not problems and "d2t" in tensors and "t2d" in tensors:
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        draft_ids = torch.arange(len(d2t)) + d2t
        if draft_ids.min() < 0 or draft_ids.max() >= len(t2d) or not bool(t2d[draft_ids].all()) \
                or int(t2d.sum()) != len(d2t) or not bool((draft_ids[1:] > draft_ids[:-1]).all()):
            problems.append(f"{weights}: d2t and t2d disagree (draft ids must be sorted, in range and exactly "
                            "the ids t2d marks)")
    return problems


def load_export(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an export folder. Raises ValueError naming the file when it is missing or unreadable."""
    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ValueError(f"{f}: missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
        raise ValueError(f"{weights}: unreadable safetensors file ({exc})") from exc
    return tensors, cfg


def check_export(path: Path) -> list[str]:
    """Reload an export folder and return every problem found (empty list: the export is loadable)."""
    try:
        tensors, cfg = load_export(path)
    except ValueError as exc:
        return [str(exc)]
    return check_tensors(tensors, cfg)


def read_draft(checkpoint_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(full draft tensors, export config dict) of a checkpoint folder, or of the one a ``latest`` marker in it
    names. Raises ValueError naming the missing file when the folder is not a checkpoint written by run.py."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / LATEST).is_file():
        checkpoint_dir = checkpoint_dir / (checkpoint_dir / LATEST).read_text().strip()
    weights, cfg_file = checkpoint_dir / DRAFT_FILE, checkpoint_dir / DRAFT_CONFIG_FILE
    for f in (weights, cfg_file):
        if not f.is_file():
            raise ValueError(f"{f}: missing — is {checkpoint_dir} a checkpoint folder written by run.py?")
    with safe_open(str(weights), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    return state, json.loads(cfg_file.read_text())
