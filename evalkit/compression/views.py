"""What a method sees: one layer's prompt at the end of prefill (:class:`PrefillView`) and one decode step of one
layer after its attention (:class:`DecodeView`). The runtime fills them; methods read them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PrefillView:
    """What a policy may look at when it scores one layer's prompt tokens (one call per layer, whole batch)."""

    # [B, Hq, q, D] post-RoPE queries of the prompt's last q tokens: every token (q = n), or under chunked prefill
    # those the cache kept for the policy (its ``prefill_queries``; for ``sums_attention`` policies the last chunk's)
    query: torch.Tensor
    keys: torch.Tensor  # [B, Hkv, n, D] post-RoPE keys
    values: torch.Tensor  # [B, Hkv, n, D]
    key_valid: torch.Tensor  # [B, n] bool: False on left padding
    scaling: float
    layer_idx: int
    num_layers: int
    module: torch.nn.Module  # the attention module
    positions: torch.Tensor  # [B, n] long: text positions of the prompt tokens
    rotary: object = None  # the model's rotary embedding: rotary(x, position_ids) -> (cos, sin)
    # Chunked prefill: the attention the prompt's earlier queries (those before ``query``) gave each key, summed,
    # fp32 ``[B, Hkv, G, n']`` (n' <= n: the keys they could see); :func:`causal_attention_sums` adds it.
    prior_sums: torch.Tensor | None = None
    # A cache ranked as a prompt (a method re-applied while decoding) whose heads hold different tokens: each head's
    # own validity ``[B, Hkv, n]`` (``key_valid`` is then any head's). None: every head holds ``key_valid``.
    head_valid: torch.Tensor | None = None
    # ``[B, n, d_model]``: the attention's input for every prompt token (a ``reads_hidden_states`` policy's; else None)
    hidden: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.keys.shape[1]

    @property
    def query_positions(self) -> torch.Tensor:
        """``[B, q]``: the text positions of the queries (the prompt's last q tokens)."""
        return self.positions[:, self.positions.shape[1] - self.query.shape[2]:]


@dataclasses.dataclass
class DecodeView:
    """One decode step of one layer, after its attention: what a decode-time eviction policy looks at."""

    probabilities: torch.Tensor  # [B, Hq, S] fp32 attention of this step's query over the layer's slots
    valid: torch.Tensor  # [B, Hkv, S] bool: slot holds a token (this step's included)
    positions: torch.Tensor  # [B, Hkv, S] long: text position of each slot's token (-1: empty)
    position: torch.Tensor  # [B] text position of this step's token
    scores: torch.Tensor | None  # [B, Hkv, S] fp32 running score of an ``accumulates`` policy, updated in place by it
    query_buffer: torch.Tensor | None  # [B, Hq, w, D] post-RoPE queries of the last w tokens (``query_window``)
    keys: torch.Tensor  # [B, Hkv, S, D]
    scaling: float
    steps: torch.Tensor  # [B] long: decode steps each row has taken, this one included
    capacity: int
    sinks: torch.Tensor | None = None  # [Hq] learned attention-sink logits of the layer (gpt-oss), else None
    # What a prefill scorer re-applied while decoding reads (DecodingSnapKV's ``scorer``): the layer's values
    # ``[B, Hkv, S, D]``, its attention module and the model's rotary embedding.
    values: torch.Tensor | None = None
    module: torch.nn.Module | None = None
    rotary: object = None
    # ``[B, 1, d_model]``: this step's attention input, for a policy that scores new tokens from it
    # (``evicts_while_decoding`` and ``reads_hidden_states``: Threshold over KVzap); else None
    hidden: torch.Tensor | None = None


def held_as_prompt(held: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, *,
                   query: torch.Tensor, scaling: float, layer_idx: int, num_layers: int, module: torch.nn.Module,
                   rotary=None) -> tuple[PrefillView, torch.Tensor]:
    """The tokens ``held`` ``[B, Hkv, S]`` (of ``keys``/``values`` ``[B, Hkv, S, D]`` at text ``positions``
    ``[B, Hkv, S]``) as a prompt a method can rank: each head's tokens in text order, the others before them as a
    prompt's left padding (each head its own where heads hold different counts). Returns the view and the ``order``
    ``[B, Hkv, S]`` that made it: position ``i`` of the view is slot ``order[..., i]``."""
    order = positions.masked_fill(~held, -1).argsort(dim=-1, stable=True)  # the others first, then text order

    def in_order(tensor: torch.Tensor) -> torch.Tensor:
        index = order if tensor.dim() == 3 else order[..., None].expand(-1, -1, -1, tensor.shape[-1])
        return tensor.gather(2, index)

    ordered = in_order(held)
    equal = bool((ordered == ordered[:, :1]).all())  # every head holds as many
    view = PrefillView(query=query, keys=in_order(keys), values=in_order(values), key_valid=ordered.any(dim=1),
                       scaling=scaling, layer_idx=layer_idx, num_layers=num_layers, module=module,
                       positions=in_order(positions)[:, 0].clamp(min=0), rotary=rotary,
                       head_valid=None if equal else ordered)
    return view, order


def row_of(view: PrefillView, row: int) -> tuple[PrefillView, int]:
    """Row ``row`` of ``view`` as a batch of one unpadded prompt (what a reference that scores one prompt at a time
    sees), and the index of its first real token in ``view``. Methods whose scores depend on the whole prompt
    (statistics over it, chunks counted from its start) score each row this way, so a left-padded batch gives each
    prompt what it gives alone."""
    if view.head_valid is not None:
        raise ValueError("this method ranks a prompt whose heads hold the same tokens; it cannot rank a cache whose "
                         "heads hold different ones")
    n, count = view.keys.shape[2], view.query.shape[2]
    first = n - int(view.key_valid[row].sum())
    queries = view.query[row : row + 1, :, max(0, first - (n - count)):]
    return PrefillView(query=queries, keys=view.keys[row : row + 1, :, first:],
                       values=view.values[row : row + 1, :, first:], key_valid=view.key_valid[row : row + 1, first:],
                       scaling=view.scaling, layer_idx=view.layer_idx, num_layers=view.num_layers, module=view.module,
                       positions=view.positions[row : row + 1, first:], rotary=view.rotary,
                       hidden=None if view.hidden is None else view.hidden[row : row + 1, first:]), first


def scores_by_row(view: PrefillView, score) -> torch.Tensor:
    """``score(row_view) -> [1, H, m]`` for each row of ``view`` alone (:func:`row_of`), as ``[B, H, n]`` (zeros on
    left padding)."""
    rows = []
    for row in range(view.keys.shape[0]):
        alone, first = row_of(view, row)
        rows.append(torch.nn.functional.pad(score(alone).float(), (first, 0)))
    return torch.cat(rows)


def span(view: PrefillView, start: int, end: int, heads: slice = slice(None)) -> PrefillView:
    """Tokens ``start..end-1`` of a one-prompt unpadded view (:func:`row_of`), KV heads ``heads``, as a prompt of
    their own: their keys, values and positions, and their queries where the view holds every query (else the
    view's, unused by a method that reads none)."""
    n, groups = view.keys.shape[2], view.groups
    query_heads = slice(None) if heads == slice(None) else slice(heads.start * groups, heads.stop * groups)
    query = view.query[:, query_heads]
    if query.shape[2] == n:
        query = query[:, :, start:end]
    return dataclasses.replace(view, query=query, keys=view.keys[:, heads, start:end],
                               values=view.values[:, heads, start:end], key_valid=view.key_valid[:, start:end],
                               positions=view.positions[:, start:end], prior_sums=None,
                               hidden=None if view.hidden is None else view.hidden[:, start:end])


def dropped_by_reselection(view: DecodeView, select) -> torch.Tensor:
    """``[B, Hkv, S]``: the slots ``select(prompt, kv_heads)`` drops when it selects from a decode step's cache as from
    a prompt (:func:`held_as_prompt`: each head's tokens in text order, its empty slots before them as left padding)."""
    valid = view.valid
    config = getattr(view.module, "config", None)
    prompt, order = held_as_prompt(valid, view.keys, view.values, view.positions, query=view.query_buffer,
                                   scaling=view.scaling, layer_idx=getattr(view.module, "layer_idx", 0),
                                   num_layers=getattr(config, "num_hidden_layers", 1), module=view.module,
                                   rotary=view.rotary)
    held = valid.gather(-1, order)
    indices, counts, _ = select(prompt, valid.shape[1])
    picked = torch.arange(indices.shape[-1], device=valid.device) < counts[..., None]
    kept = torch.zeros_like(held).scatter_(-1, indices, picked)
    return torch.zeros_like(valid).scatter_(-1, order, held & ~kept)
