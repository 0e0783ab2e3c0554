"""Incremental inference of an EAGLE-3 draft: reading it (every layout ``--init-draft`` reads), its KV cache, chain
drafting.

How EAGLE-3 inference maps onto training-time test (docs/algorithm.md, "Attention of step k"; docs/architecture.md).
Known tokens ``t_0..t_n``, the target's aux features ``a_0..a_n`` and its greedy next token ``t_{n+1}``:

- *extend* (TTT step 0): anchor ``j`` reads ``(fc(a_j), t_{j+1})`` at RoPE position ``j``; its key/value go into the
  cache at position ``j``. Its output hidden at anchor ``n`` gives the first draft token ``d_1`` (lm_head, argmax).
- *chain* step ``i`` (TTT step ``i``): reads ``(h_{i-1}, d_i)`` where ``h_{i-1}`` is the previous output (before
  the final norm) at anchor ``n``; RoPE position ``n + i``; its key is cached at position ``n + i``.
- every query attends all cached keys at positions ``<=`` its own: plain causal attention over one KV cache, as in
  SGLang/SpecForge. For the chain query of step ``i`` that set is ``{K_0[j] : j <= n} ∪ {K_1[n], ..., K_i[n]}``,
  exactly the training-time key set of TTT step ``i`` at anchor ``n`` (the causal block plus the diagonal keys).
- after verification the chain's entries (computed from draft hidden states) are dropped; the accepted tokens are
  then *extended* with the target's own features, so the cache always holds step-0 entries for positions ``0..n``.

Token ids: the draft's lm_head is over the draft vocabulary; draft id ``i`` is target id ``i + d2t[i]``.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.attention_backends import make_causal_attention
from recipe.export import REQUIRED_CONFIG, check_tensors
from recipe.export.import_draft import load_draft
from recipe.model.draft import Eagle3Draft
from recipe.model.draft_config import Eagle3DraftConfig
from recipe.target.registry import draft_config_for


def read_draft(path: str | Path, target_config) -> tuple[dict[str, torch.Tensor], Eagle3DraftConfig]:
    """``(export tensors, draft config)`` of a draft in any layout ``run.py --init-draft`` reads
    (``recipe.export.import_draft.load_draft``: this project's export, SpecForge's and the EAGLE repository's folders,
    a ``midlayer.*`` or ``layers.0.*`` safetensors or pickle file; the vocabulary map completed).

    The config: its config.json when that is a whole export config; otherwise each field it states and the others as
    a run derives them from the target's HF ``target_config`` (``recipe.target.registry.draft_config_for``, the
    draft vocabulary of its lm_head rows). The aux layers are the ones it states, else the target's default ids
    (as SGLang and vLLM serve it, and as ``run.py --init-draft`` trains it). Raises
    ValueError naming ``--draft`` and the path with every problem (unreadable files, wrong keys, shapes or dtypes,
    d2t/t2d disagreeing, a config that is no EAGLE-3 draft's)."""
    imported = load_draft(Path(path), int(target_config.vocab_size), flag="--draft")
    stated, aux = imported.config, imported.stated_aux_layer_ids
    try:
        if aux is None or any(key not in stated for key in REQUIRED_CONFIG):
            rows = imported.tensors["lm_head.weight"].shape[0] if "lm_head.weight" in imported.tensors else 1
            derived = draft_config_for(target_config, rows, {"aux_layer_ids": aux} if aux else {}).to_hf_dict()
            stated = {**derived, **stated, "eagle_config": derived["eagle_config"]}
        config = Eagle3DraftConfig.from_hf_dict(stated)
        problems = check_tensors(imported.tensors, config.to_hf_dict(), imported.weights.name)
    except (ValueError, TypeError) as exc:
        problems = [str(exc)]
    if problems:
        raise ValueError(f"--draft {path}: not a loadable EAGLE-3 draft ({imported.layout} layout):\n  "
                         + "\n  ".join(problems))
    return imported.tensors, config


def build_draft(tensors: dict[str, torch.Tensor], config: Eagle3DraftConfig, embed_VH: torch.Tensor,
                device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                attention_backend: str = "auto", source: str | Path = "draft") -> Eagle3Draft:
    """The ``Eagle3Draft`` of :func:`read_draft`'s ``tensors`` and ``config``, in eval mode on ``device`` in
    ``dtype`` (None: the draft's own, that of its ``fc.weight``; a bf16 training run exports bf16).

    ``embed_VH`` [V, H_t] is the target's input embedding (an export has none). Its causal block (the
    ``DraftKVCache`` attention) comes from
    ``kernels.attention_backends.make_causal_attention(attention_backend, None, device)``. Raises ValueError naming
    ``source`` when the embedding shape does not fit, and ValueError for an attention backend that is unknown or
    cannot run on ``device``.
    """
    attention = make_causal_attention(attention_backend, None, device)
    dtype = tensors["fc.weight"].dtype if dtype is None else dtype
    draft = Eagle3Draft(config, seed=0)
    try:
        draft.load_target_embeddings(embed_VH.float())
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    state = dict(tensors, **{"embed_tokens.weight": draft.embed_tokens.weight})
    draft.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
    draft.midlayer.self_attn.causal_attention = attention
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


WINDOW_QUERY_CHUNK = 1024  # queries per masked attention call of a windowed extend


class DraftKVCache:
    """The draft layer's inference KV cache for one sequence (batch 1): keys/values with their positions.

    Implements the two methods ``Eagle3Draft.step`` talks to: ``rope_positions`` (identity: the RoPE position of a
    query is its cache position) and ``attend`` (append this call's keys, then causal attention of the new queries
    over every cached key at a position ``<=`` theirs). ``crop(n)`` keeps the first ``n`` entries.

    ``window`` (None: off): the draft's sliding window, as SGLang serves it (``--speculative-draft-window-size``):
    a query at RoPE position ``p`` attends only the keys at positions ``p - window < q <= p`` (its last ``window``
    positions, itself included); RoPE positions stay absolute. Keys older than the window of every new query are
    left out of the attention; a single query then runs the causal block on the rest, several (an extend) an explicit
    window mask (``window_mask``) over chunks of ``WINDOW_QUERY_CHUNK`` queries.
    """

    def __init__(self, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"draft window must be >= 1 position, got {window}")
        self.window = window
        self.k_BHkvSD: torch.Tensor | None = None
        self.v_BHkvSD: torch.Tensor | None = None
        self.pos_BS: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.pos_BS is None else int(self.pos_BS.shape[1])

    def rope_positions(self, position_ids_BS: torch.Tensor) -> torch.Tensor:
        return position_ids_BS

    def _append(self, k_BHkvSD, v_BHkvSD, position_ids_BS) -> None:
        if self.pos_BS is None:
            self.k_BHkvSD, self.v_BHkvSD, self.pos_BS = k_BHkvSD, v_BHkvSD, position_ids_BS
        else:
            self.k_BHkvSD = torch.cat([self.k_BHkvSD, k_BHkvSD], dim=2)
            self.v_BHkvSD = torch.cat([self.v_BHkvSD, v_BHkvSD], dim=2)
            self.pos_BS = torch.cat([self.pos_BS, position_ids_BS], dim=1)

    def in_window(self, position_ids_BS: torch.Tensor) -> torch.Tensor:
        """Bool [cache length]: the cached keys inside the window of at least one of the queries at
        ``position_ids_BS`` (all True without a window)."""
        if self.window is None:
            return torch.ones_like(self.pos_BS[0], dtype=torch.bool)
        return self.pos_BS[0] > position_ids_BS.min() - self.window

    def attend(self, causal_attention, q_BHSD, k_BHkvSD, v_BHkvSD, position_ids_BS, key_valid_BS):
        """Append the keys, then ``causal_attention`` over the whole cache (or its window); returns out_BHSD."""
        self._append(k_BHkvSD, v_BHkvSD, position_ids_BS)
        if self.window is None:
            out_BHSD, _ = causal_attention(q_BHSD, self.k_BHkvSD, self.v_BHkvSD, position_ids_BS, self.pos_BS, None)
            return out_BHSD
        if q_BHSD.shape[2] == 1:
            keep = self.in_window(position_ids_BS).nonzero()[:, 0]
            out_BHSD, _ = causal_attention(q_BHSD, self.k_BHkvSD[:, :, keep], self.v_BHkvSD[:, :, keep],
                                           position_ids_BS, self.pos_BS[:, keep], None)
            return out_BHSD
        outs = []  # query chunks: a mask of chunk × (window + chunk) at most, not of m × cache length
        for c in range(0, q_BHSD.shape[2], WINDOW_QUERY_CHUNK):
            q_pos_Q = position_ids_BS[0, c:c + WINDOW_QUERY_CHUNK]
            pos_K = self.pos_BS[0]
            keep = ((pos_K > q_pos_Q.min() - self.window) & (pos_K <= q_pos_Q.max())).nonzero()[:, 0]
            allowed_QK = window_mask(q_pos_Q, self.pos_BS[0, keep], self.window)
            outs.append(F.scaled_dot_product_attention(q_BHSD[:, :, c:c + WINDOW_QUERY_CHUNK],
                                                       self.k_BHkvSD[:, :, keep], self.v_BHkvSD[:, :, keep],
                                                       attn_mask=allowed_QK[None, None], enable_gqa=True))
        return torch.cat(outs, dim=2)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached entries (ValueError if the cache holds fewer)."""
        if length > len(self):
            raise ValueError(f"cannot crop a draft KV cache of {len(self)} entries to {length}")
        if self.pos_BS is not None:
            self.k_BHkvSD = self.k_BHkvSD[:, :, :length]
            self.v_BHkvSD = self.v_BHkvSD[:, :, :length]
            self.pos_BS = self.pos_BS[:, :length]


def window_mask(q_pos_Q: torch.Tensor, k_pos_K: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [Q, K], True where query i may read key j: ``k_pos[j] <= q_pos[i]`` and, with a ``window``,
    ``k_pos[j] > q_pos[i] - window`` (positions are RoPE positions)."""
    allowed = k_pos_K[None, :] <= q_pos_Q[:, None]
    if window is not None:
        allowed &= k_pos_K[None, :] > q_pos_Q[:, None] - window
    return allowed


class EagleDrafter:
    """Chain drafting with an exported EAGLE-3 draft; the ``Drafter`` interface of ``recipe.eval.speculative``.

    ``begin()`` starts a sequence. ``propose(aux_SA, next_ids_S, k)`` receives the target features ``a_j`` [m, A] of
    the ``m`` anchors accepted since the last call (the prompt, at the first call) and the tokens ``t_{j+1}`` [m]
    that follow them (the last one is the target's newest greedy token), and returns ``k`` proposed target ids.
    ``window``: the draft's sliding window in positions (``DraftKVCache``; None: full attention). ``columns``: the
    indices of this draft's aux features in a wider ``aux_SA`` (a target capturing the aux layers of several drafts;
    None: all of them).
    """

    def __init__(self, draft: Eagle3Draft, window: int | None = None, columns: torch.Tensor | None = None):
        self.draft = draft
        self.window, self.columns = window, columns
        self.device = draft.fc.weight.device
        self.draft_to_target = draft.draft_token_ids()
        self.cache = DraftKVCache(window)
        self.committed = 0  # anchors with step-0 entries in the cache (positions 0..committed-1)

    def begin(self) -> None:
        self.cache = DraftKVCache(self.window)
        self.committed = 0

    @torch.no_grad()
    def extend(self, aux_SA: torch.Tensor, next_ids_S: torch.Tensor) -> torch.Tensor:
        """Drop chain entries, then add step-0 entries for ``m`` new anchors; returns their output hidden [m, H]."""
        self.cache.crop(self.committed)
        m = int(aux_SA.shape[0])
        if self.columns is not None:
            aux_SA = aux_SA[:, self.columns]
        pos_BS = torch.arange(self.committed, self.committed + m, device=self.device)[None]
        hidden_BSH = self.draft.project_aux(aux_SA.to(self.device)[None])
        out_BSH, _ = self.draft.step(hidden_BSH, next_ids_S.to(self.device)[None], pos_BS, kv_cache=self.cache)
        self.committed += m
        return out_BSH[0]

    @torch.no_grad()
    def chain_step(self, hidden_H: torch.Tensor, token_id: int, step: int) -> torch.Tensor:
        """Chain step ``step`` (>= 1) from the last anchor: input ``(hidden_H, token_id)`` at RoPE position
        ``committed - 1 + step``; returns the output hidden [H] (before the final norm)."""
        pos_BS = torch.tensor([[self.committed - 1 + step]], device=self.device)
        ids_BS = torch.tensor([[token_id]], device=self.device)
        out_BSH, _ = self.draft.step(hidden_H[None, None], ids_BS, pos_BS, kv_cache=self.cache)
        return out_BSH[0, 0]

    def _greedy_target_id(self, hidden_H: torch.Tensor) -> int:
        return int(self.draft_to_target[int(self.draft.logits(hidden_H).argmax())])

    @torch.no_grad()
    def propose(self, aux_SA: torch.Tensor, next_ids_S: torch.Tensor, k: int) -> list[int]:
        hidden_H = self.extend(aux_SA, next_ids_S)[-1]
        tokens = [self._greedy_target_id(hidden_H)]
        for step in range(1, k):
            hidden_H = self.chain_step(hidden_H, tokens[-1], step)
            tokens.append(self._greedy_target_id(hidden_H))
        return tokens


def draft_window(window: int | None | dict[str, int | None], label: str) -> int | None:
    """The sliding window of draft ``label``: ``window`` itself, or its entry when ``window`` is a per-draft dict
    (None: full attention)."""
    return window.get(label) if isinstance(window, dict) else window
