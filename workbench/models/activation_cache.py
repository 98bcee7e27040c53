"""The activation cache of one forward, with TransformerLens's ``ActivationCache`` methods.

``run_with_cache(model, x, ...)`` runs the glass-box ViT's one forward with recorders on the
selected hook points (``workbench.models.hooks.user_hooks``) and, with ``incl_bwd=True``, one
backward of a scalar ``metric(logits)`` for the gradient at every recorded point. The
model's methods ``run_with_cache`` / ``run_with_hooks`` / ``hooks`` and the functions of
``workbench.interventions.cache`` are this code; there is no second forward.

The residual-stream methods read the cache the way TransformerLens (TL) does, in this
model's names: the residual entering block ``l`` is ``blocks.{l-1}.resid2`` (``pos_add``, or
``norm_pre`` where the model has one, for block 0), ``resid1`` is TL's ``resid_mid`` and
``resid2`` its ``resid_post``; a branch's contribution to the residual is its ``attn`` /
``mlp`` stage, or ``ls1`` / ``ls2`` with LayerScale. Two differences from TL, both because this
model's weights are not folded: ``apply_ln_to_stack`` applies the norm's weight (TL folds it
into the unembedding), and neither it nor ``stack_head_results`` nor ``logit_attrs`` adds a
bias, which is a constant and no component's (the norm's bias, ``out_proj``'s bias, the
head's bias: add them to a sum over components, as the docstrings say).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from workbench.models.hooks import (
    HookError,
    UserHook,
    hook_paths,
    hook_points,
    resolve_hook,
    user_hooks,
)

NamesFilter = str | Iterable[str] | Callable[[str], bool] | None
PosSlice = int | slice | list[int] | torch.Tensor | None
Metric = Callable[[torch.Tensor], torch.Tensor]

# TL's short names in cache[(name, layer)], beside this model's own stage names
_TL_STAGES = {
    "resid_mid": "resid1",
    "resid_post": "resid2",
    "attn_out": "attn",
    "mlp_out": "mlp",
    "pattern": "attn.probs",
    "z": "attn.z",
}


class ActivationCache(Mapping[str, torch.Tensor]):
    """Hook-point name -> activation of one forward, in the order the forward ran them.

    Keys are the hook-point names (``blocks.0.resid2``); indexing also takes a module path
    (``cache["blocks.0.hook_resid2"]``) and TL's tuple form (``cache["resid_post", 0]``,
    ``cache["resid2", -1]``, ``cache["resid_pre", 2]``, ``cache["pattern", 1]``). With
    ``incl_bwd=True`` the gradient at a point is under its name plus ``_grad``
    (``blocks.0.resid2_grad``), as in TL.
    """

    def __init__(
        self, activations: dict[str, torch.Tensor], model: nn.Module, has_batch_dim: bool = True
    ) -> None:
        self._acts = activations
        self.model = model
        self.has_batch_dim = has_batch_dim

    # ---- the mapping -------------------------------------------------------------------
    def __getitem__(self, key: str | tuple) -> torch.Tensor:
        if isinstance(key, tuple):
            return self._tl_item(*key)
        if key in self._acts:
            return self._acts[key]
        names = {path: name for name, path in hook_paths(self.model).items()}
        if key in names and names[key] in self._acts:
            return self._acts[names[key]]
        raise KeyError(f"{key!r} is not in the cache; cached: {', '.join(self._acts)}")

    def _tl_item(self, stage: str, layer: int) -> torch.Tensor:
        depth = self.model.cfg.depth
        if not -depth <= layer < depth:
            raise KeyError(f"layer {layer} of {stage!r}: the model has blocks 0-{depth - 1}")
        layer %= depth
        if stage == "resid_pre":
            return self.resid_pre(layer)
        return self[f"blocks.{layer}.{_TL_STAGES.get(stage, stage)}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {', '.join(self._acts)})"

    def blocks_of(self, stage: str) -> list[int]:
        """The block indices whose ``blocks.i.<stage>`` is cached, ascending."""
        parts = [k.split(".", 2) for k in self._acts if k.startswith("blocks.")]
        return sorted(int(i) for _, i, rest in parts if rest == stage)

    def stack(self, stage: str) -> torch.Tensor:
        """``blocks.i.<stage>`` of every cached block stacked on a new first axis: (L, ...).

        ``stack("resid2")`` is (L, B, N, D); ``stack("attn.z")`` is (L, B, N, heads, d).

        Raises:
            KeyError: No block's ``<stage>`` is cached (the message lists what is).
        """
        blocks = self.blocks_of(stage)
        if not blocks:
            raise KeyError(f"no 'blocks.i.{stage}' in the cache; cached: {', '.join(self._acts)}")
        return torch.stack([self._acts[f"blocks.{i}.{stage}"] for i in blocks])

    def remove_batch_dim(self) -> ActivationCache:
        """Drop the batch axis of a one-image cache, in place (as TL's); returns the cache.

        Raises:
            HookError: A cached tensor's first axis is not 1.
        """
        if self.has_batch_dim:
            wide = [n for n, a in self._acts.items() if a.shape[:1] != (1,)]
            if wide:
                raise HookError(
                    f"remove_batch_dim needs a batch of 1; {wide[0]!r} is {tuple(self._acts[wide[0]].shape)}"
                )
            self._acts = {n: a[0] for n, a in self._acts.items()}
            self.has_batch_dim = False
        return self

    def to(self, device: str | torch.device) -> ActivationCache:
        """Move every cached tensor to ``device``, in place (as TL's); returns the cache."""
        self._acts = {n: a.to(device) for n, a in self._acts.items()}
        return self

    # ---- the residual stream -------------------------------------------------------------
    def resid_pre(self, layer: int) -> torch.Tensor:
        """The residual entering block ``layer`` (TL's ``resid_pre``); ``layer = depth``: the last output."""
        if layer > 0:
            return self._need(f"blocks.{layer - 1}.resid2")
        return self._need("norm_pre" if self.model.cfg.norm_pre else "pos_add")

    def _need(self, name: str) -> torch.Tensor:
        if name not in self._acts:
            raise KeyError(
                f"{name!r} is needed and not in the cache: run_with_cache with a names_filter "
                f"that keeps it (cached: {', '.join(self._acts) or 'nothing'})"
            )
        return self._acts[name]

    def _layer(self, layer: int | None) -> int:
        """TL's convention: None, -1 and depth all mean after the last block."""
        depth = self.model.cfg.depth
        if layer is None or layer == -1:
            return depth
        if not 0 <= layer <= depth:
            raise HookError(
                f"layer {layer}: valid layers are 0-{depth}, -1 or None (after the last block)"
            )
        return layer

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ):
        """The residual stream entering each block up to ``layer``, stacked: (C, B, N, D).

        As TL's: ``l_pre`` for blocks 0..layer (``incl_mid``: also each ``l_mid`` before
        ``layer``; ``mlp_input``: ``layer``'s ``mid``), and with ``layer`` None / -1 / depth the
        last block's output (``final_post``) as the last entry. ``apply_ln``: through
        ``apply_ln_to_stack`` at ``layer`` (the final norm for the default, with the final
        residual's statistics for every entry, as TL).
        """
        top = self._layer(layer)
        parts, labels = [], []
        for ell in range(top + 1):
            if ell == self.model.cfg.depth:
                parts.append(self._need(f"blocks.{ell - 1}.resid2"))
                labels.append("final_post")
                continue
            parts.append(self.resid_pre(ell))
            labels.append(f"{ell}_pre")
            if (incl_mid and ell < top) or (mlp_input and ell == top):
                parts.append(self._need(f"blocks.{ell}.resid1"))
                labels.append(f"{ell}_mid")
        return self._finish(parts, labels, layer, mlp_input, apply_ln, pos_slice, return_labels)

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ):
        """The residual entering ``layer`` split into what wrote it: (C, B, N, D), summing to it.

        Components, as TL's: ``embed`` (the tokens with their prefix, before positions; with
        ``norm_pre`` the normed tokens entering block 0, which do not split further),
        ``pos_embed`` (the position term, zero on prefix tokens the model adds no position to),
        then ``{l}_attn_out`` and ``{l}_mlp_out`` of each block before ``layer`` (after
        LayerScale: what the block adds), and ``mlp_input`` adds ``layer``'s ``attn_out``.
        ``mode``: ``all``, ``attn`` or ``mlp`` (which branches); ``incl_embeds=False`` leaves out
        the embeddings (then the sum is not the residual).
        """
        if mode not in ("all", "attn", "mlp"):
            raise HookError(f"mode {mode!r}: valid modes are all, attn, mlp")
        top = self._layer(layer)
        parts, labels = self._embeds() if incl_embeds else ([], [])
        scaled = self.model.cfg.layer_scale_init is not None
        for ell in range(top + (1 if mlp_input and top < self.model.cfg.depth else 0)):
            if mode in ("all", "attn"):
                parts.append(self._need(f"blocks.{ell}.{'ls1' if scaled else 'attn'}"))
                labels.append(f"{ell}_attn_out")
            if mode in ("all", "mlp") and ell < top:
                parts.append(self._need(f"blocks.{ell}.{'ls2' if scaled else 'mlp'}"))
                labels.append(f"{ell}_mlp_out")
        return self._finish(parts, labels, layer, mlp_input, apply_ln, pos_slice, return_labels)

    def _embeds(self) -> tuple[list[torch.Tensor], list[str]]:
        model, cfg = self.model, self.model.cfg
        if cfg.norm_pre:
            return [self._need("norm_pre")], ["embed"]
        tokens = self._need("patch_embed.norm" if cfg.embed_norm else "patch_embed")
        lead = tokens.shape[:-2]  # (B,) or () after remove_batch_dim
        prefix = [
            t.reshape(t.shape[-2:]).expand(*lead, -1, -1).to(tokens)
            for t in (model.cls_token, model.register_tokens)
            if t is not None
        ]
        embed = torch.cat(prefix + [tokens], dim=-2) if prefix else tokens
        if model.pos_embed is None:
            return [embed], ["embed"]
        pos = self._acts.get("pos_embed", model.pos_embed).to(tokens)
        pos = pos.reshape(pos.shape[-2:])
        if cfg.no_embed_class and prefix:
            pos = torch.cat([pos.new_zeros(embed.shape[-2] - pos.shape[-2], pos.shape[-1]), pos])
        return [embed, pos.expand_as(embed)], ["embed", "pos_embed"]

    def stack_head_results(
        self,
        layer: int = -1,
        pos_slice: PosSlice = None,
        return_labels: bool = False,
        apply_ln: bool = False,
    ):
        """Each head's contribution to the residual, stacked over blocks before ``layer`` and heads.

        Head h of block l writes ``z[..., h, :] @ W_h.T`` (times LayerScale's gain), with
        ``W_h = out_proj.weight[:, h*d:(h+1)*d]`` its slice of the output projection: (L*H, B,
        N, D), labels ``L{l}H{h}`` (as TL). Summed over a block's heads, plus ``out_proj.bias``
        (times the gain), it is the block's attention output. Needs ``blocks.i.attn.z``.

        Raises:
            HookError: A model with ``attn.norm`` (a norm over all heads: no per-head split).
        """
        if self.model.cfg.scale_attn_norm:
            raise HookError(
                "stack_head_results: this model normalises all heads together (attn.norm) before "
                "out_proj, so a head's contribution is not its own slice"
            )
        parts, labels = [], []
        for ell in range(self._layer(layer)):
            block = self.model.blocks[ell]
            z = self._need(f"blocks.{ell}.attn.z")  # (..., N, H, d)
            heads, d = z.shape[-2:]
            weight = block.attn.out_proj.weight.to(z)  # (D, H*d)
            for h in range(heads):
                out = z[..., h, :] @ weight[:, h * d : (h + 1) * d].T  # (..., N, D)
                parts.append(out * block.ls1.gamma.to(z) if hasattr(block.ls1, "gamma") else out)
                labels.append(f"L{ell}H{h}")
        return self._finish(parts, labels, layer, False, apply_ln, pos_slice, return_labels)

    def _finish(self, parts, labels, layer, mlp_input, apply_ln, pos_slice, return_labels):
        if not parts:
            raise HookError(
                f"no component up to layer {layer} (with these options nothing wrote it)"
            )
        stack = _slice_pos(torch.stack(parts), pos_slice)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    # ---- the norm and the head -------------------------------------------------------------
    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: PosSlice = None,
    ) -> torch.Tensor:
        """Each component through the norm at ``layer``, with the statistics of the real forward.

        As TL's: the norm read is the final one for ``layer`` None / -1 / depth, else block
        ``layer``'s ``norm1`` (``norm2`` with ``mlp_input``); its scale (LayerNorm
        ``sqrt(var + eps)``, RMSNorm ``sqrt(mean(x^2) + eps)``) is computed from the residual
        that entered that norm in the cached forward, so the map is linear in the components:
        LayerNorm centres each and divides by the cached scale. Unlike TL (which folds it into
        the next weights) the norm's weight is applied; its bias is not (a constant, no
        component's): ``apply_ln_to_stack(decompose_resid()).sum(0) + norm.bias`` is the norm's
        output. ``pos_slice`` slices the scale's positions to match a sliced stack.
        """
        norm, source = self._norm_and_input(self._layer(layer), mlp_input)
        if isinstance(norm, nn.LayerNorm):
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
            var = source.var(-1, unbiased=False, keepdim=True)
        else:
            var = source.pow(2).mean(-1, keepdim=True)
        scale = _slice_pos((var + norm.eps).sqrt(), pos_slice)
        out = residual_stack / scale
        return out * norm.weight.to(out) if norm.weight is not None else out

    def _norm_and_input(self, layer: int, mlp_input: bool) -> tuple[nn.Module, torch.Tensor]:
        model = self.model
        if layer < model.cfg.depth:
            block = model.blocks[layer]
            if mlp_input:
                return block.norm2, self._need(f"blocks.{layer}.resid1")
            return block.norm1, self.resid_pre(layer)
        if not model.cfg.has_norm:
            raise HookError(
                "apply_ln_to_stack: this model has no final norm (it uses fc_norm after pooling)"
            )
        return model.norm, self._need(f"blocks.{model.cfg.depth - 1}.resid2")

    def logit_attrs(
        self,
        residual_stack: torch.Tensor,
        classes: int | torch.Tensor,
        incorrect_classes: int | torch.Tensor | None = None,
        pos_slice: PosSlice = None,
    ) -> torch.Tensor:
        """Each component's direct contribution to a class logit (or a logit difference): (C, B[, N]).

        As TL's ``logit_attrs(residual_stack, tokens, incorrect_tokens, pos_slice)``: the stack
        goes through ``apply_ln_to_stack`` with the final norm, then is projected onto the
        head's row for ``classes`` (an int, or one class per image (B,)), minus the row for
        ``incorrect_classes``. Summed over a decomposition of the class token's residual, plus
        ``head.bias[c] + norm.bias @ head.weight[c]``, it is the logit (a difference of those
        for a logit difference). Only for models that read the class token (CLS pooling).
        """
        cfg = self.model.cfg
        if cfg.pooling != "cls" or not cfg.num_classes or not cfg.has_norm:
            raise HookError(
                "logit_attrs needs a classifier that reads the class token through the final norm "
                f"(pooling 'cls'); this model pools {cfg.pooling!r}"
            )
        direction = self._direction(classes)
        if incorrect_classes is not None:
            direction = direction - self._direction(incorrect_classes)
        scaled = self.apply_ln_to_stack(residual_stack, None, False, pos_slice)
        final = self._need(f"blocks.{cfg.depth - 1}.resid2")
        kept_positions = _slice_pos(final, pos_slice).dim() == final.dim()
        if direction.dim() == 2 and kept_positions:
            # (B, D) -> (B, 1, D): the same class at every position
            direction = direction.unsqueeze(-2)
        return (scaled * direction.to(scaled)).sum(-1)

    def _direction(self, classes: int | torch.Tensor) -> torch.Tensor:
        weight = self.model.head.weight  # (classes, D)
        if isinstance(classes, int):
            return weight[classes]
        return weight[torch.as_tensor(classes, device=weight.device)]

    def logit_lens(self, return_labels: bool = False):
        """Each block's output read by the model's own final norm and head: (L, B, classes).

        The norm is applied with each block's own statistics (the logit lens; not TL's
        ``accumulated_resid(apply_ln=True)``, which uses the final ones), and the head pools as
        the model does, so on a CLS-pooled model it reads the class token. The last entry is the
        logits of the forward. Needs every ``blocks.i.resid2``.
        """
        model, depth = self.model, self.model.cfg.depth
        lens = torch.stack(
            [model.forward_head(model.norm(self._need(f"blocks.{i}.resid2"))) for i in range(depth)]
        )
        labels = [f"{i}_post" for i in range(depth)]
        return (lens, labels) if return_labels else lens


def _slice_pos(t: torch.Tensor, pos_slice: PosSlice, axis: int = -2) -> torch.Tensor:
    """Positions of ``t`` (axis -2 of (..., N, D)) selected as TL's ``Slice``: an int drops the axis."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, int):
        return t.select(axis, pos_slice)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * t.dim()
        index[axis] = pos_slice
        return t[tuple(index)]
    return t.index_select(axis, torch.as_tensor(pos_slice, device=t.device))


# ---- the forward with hooks ------------------------------------------------------------------
def selected_names(model: nn.Module, names_filter: NamesFilter) -> list[str]:
    """The hook-point names ``names_filter`` keeps, in the forward's order.

    Raises:
        HookError: A name that is no hook point, or a filter that keeps nothing (one line,
            naming the filter and where the names are listed).
    """
    points = hook_points(model)
    if names_filter is None:
        return list(points)
    if callable(names_filter):
        names = [n for n in points if names_filter(n)]
    else:
        wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        keep = {resolve_hook(model, w)[0] for w in wanted}
        names = [n for n in points if n in keep]
    if not names:
        raise HookError(
            f"names_filter {_describe(names_filter)} matches no hook point; model.hook_dict "
            f"(or hook_paths(model)) lists them: {', '.join(list(points)[:4])}, ..."
        )
    return names


def _describe(names_filter) -> str:
    code = getattr(names_filter, "__code__", None)
    if code is None:
        return repr(names_filter)
    return f"{names_filter.__qualname__} ({code.co_filename}:{code.co_firstlineno})"


def run_with_cache(
    model: nn.Module,
    x: torch.Tensor,
    names_filter: NamesFilter = None,
    fwd_hooks: Iterable[tuple[str, UserHook]] = (),
    incl_bwd: bool = False,
    metric: Metric | None = None,
) -> tuple[torch.Tensor, ActivationCache]:
    """Logits and the activations of the selected hook points, for one forward.

    Args:
        model: A glass-box ViT.
        x: Images (B, C, H, W).
        names_filter: None (every hook point), a name, a list of names (or module paths), or
            a predicate on names.
        fwd_hooks: Hooks on the same call; a cached activation is what the rest of the
            forward saw (after a hook on it edited it).
        incl_bwd: Also cache the gradient of ``metric(logits)`` at every selected point, as
            ``<name>_grad`` (zeros where the metric does not depend on the point; a point the
            graph does not reach, such as a frozen parameter's, gets none).
        metric: The scalar to differentiate, ``fn(logits) -> scalar`` (TL backpropagates its
            loss; a classifier here has no loss without labels, so say which scalar).

    Raises:
        HookError: An unknown name, a filter that keeps nothing, a hook's wrong return, or
            ``incl_bwd`` without a scalar metric that has a graph.
    """
    names = selected_names(model, names_filter)
    if incl_bwd and metric is None:
        raise HookError(
            "incl_bwd=True needs metric=fn(logits) -> scalar, the value to differentiate "
            "(e.g. metric=lambda logits: logits[:, 3].sum())"
        )
    store: dict[str, torch.Tensor] = {}
    with user_hooks(model, fwd_hooks, record=names, store=store):
        logits = model(x)
        if incl_bwd:
            _cache_gradients(store, metric(logits))
    order = {n: i for i, n in enumerate(hook_points(model))}
    acts = sorted((k for k in store if not k.endswith("_grad")), key=order.__getitem__)
    grads = [f"{n}_grad" for n in acts if f"{n}_grad" in store]
    return logits, ActivationCache({n: store[n] for n in acts + grads}, model)


def _cache_gradients(store: dict[str, torch.Tensor], value: torch.Tensor) -> None:
    if value.dim() != 0 or not value.requires_grad:
        raise HookError(
            f"incl_bwd: metric returned a tensor of shape {tuple(value.shape)}"
            f"{'' if value.requires_grad else ' without a graph (run outside torch.no_grad, with parameters that require grad)'}; "
            "it must be a scalar with a graph"
        )
    names = [n for n, a in store.items() if a.requires_grad]
    grads = torch.autograd.grad(value, [store[n] for n in names], allow_unused=True)
    for name, grad in zip(names, grads):
        store[f"{name}_grad"] = torch.zeros_like(store[name]) if grad is None else grad


def run_with_hooks(
    model: nn.Module,
    x: torch.Tensor,
    fwd_hooks: Iterable[tuple[str, UserHook]] = (),
    bwd_hooks: Iterable[tuple[str, UserHook]] = (),
    metric: Metric | None = None,
) -> torch.Tensor:
    """Logits of one forward with ``fwd_hooks`` attached; every hook is removed on return or error.

    ``fn(activation, hook)`` receives the activation and the hook point (``hook.name``); what
    it returns (if not None: the same shape and dtype) replaces the activation for the rest of
    the forward. With ``bwd_hooks`` the call also differentiates ``metric(logits)`` (a scalar)
    back to the hooked points, running ``fn(grad, hook)`` there; the parameters' ``.grad`` are
    not touched. (TL removes its hooks before a backward outside the call could reach them; for
    a backward of your own, use ``with model.hooks(bwd_hooks=...)``.)
    """
    bwd_hooks = list(bwd_hooks)
    if bwd_hooks and metric is None:
        raise HookError(
            "bwd_hooks need metric=fn(logits) -> scalar, the value whose backward reaches them"
        )
    with user_hooks(model, fwd_hooks, bwd_hooks) as hooked:
        logits = model(x)
        if bwd_hooks and hooked:
            torch.autograd.grad(metric(logits), hooked, allow_unused=True)
    return logits
