"""Edges from each head to the class token's residual as each later node reads it: exact path
patching, and its attribution-patching estimate (edge AtP, Syed et al. 2023).

A head h of block i writes ``z[:, t, h] @ W_h.T`` into the residual stream (``W_h`` its slice of
the output projection, times LayerScale's gain where there is one). Every later node reads the
class token's residual through its own norm: the MLP branch of block i (after the attention
branch's write), the attention and MLP branches of each later block, and the readout (the final
norm before a class-token head). An *edge* is one head into one such reader at the class token.

- **Exact** (path patching, denoising): the corrupted run, with only that reader's input at the
  class token moved by the head's clean-minus-corrupted write ``delta``: the reader's norm output
  is replaced by ``norm(x + delta)`` at the class token, every other node reads what it read, and
  the rest of the forward follows. One partial forward per edge and pair batch.
- **Edge AtP**: ``g . delta`` with ``g`` the gradient of the summed logit difference with respect
  to that reader's input at the class token, on the corrupted run (the norm's own Jacobian applied
  to the gradient at its output, so a gradient through any other reader is not counted). One
  forward and one backward of the corrupted run for every edge at once.

Both give, per pair, the change of ``LD = logit[clean label] - logit[contrast]``; the fraction of
the clean-vs-corrupted difference restored is their mean over pairs over the mean gap, as for every
patch (``workbench.interventions.patching``). Needs a class-token readout, a final norm, and heads
with their own output slice (no norm over all heads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from workbench.interventions import InterventionError
from workbench.interventions.cache import run_with_cache
from workbench.models.hooks import attached


@dataclass(frozen=True)
class Edge:
    """Head ``head`` of block ``block`` into ``reader``: ``mlp.<j>``, ``attn.<j>`` or ``readout``."""

    block: int
    head: int
    reader: str

    @property
    def label(self) -> str:
        return f"L{self.block}H{self.head}->{self.reader}"


def edges(model) -> list[Edge]:
    """Every edge of ``model``: each head into each later reader of the class token's residual."""
    cfg = model.cfg
    if cfg.pooling != "cls" or not cfg.has_norm or cfg.scale_attn_norm:
        raise InterventionError(
            "edge patching needs a class-token readout behind a final norm and heads with their "
            "own output slice"
        )
    out = []
    for i in range(cfg.depth):
        readers = [f"mlp.{i}"] + [
            f"{k}.{j}" for j in range(i + 1, cfg.depth) for k in ("attn", "mlp")
        ]
        readers.append("readout")
        out += [Edge(i, h, r) for h in range(cfg.heads) for r in readers]
    return out


def _reader_points(model, reader: str) -> tuple[str, str, torch.nn.Module, int]:
    """(hook point of the reader's norm output, cache key of the residual it normalises, the norm
    module, the block the forward resumes at)."""
    if reader == "readout":
        last = model.cfg.depth - 1
        return "norm", f"blocks.{last}.resid2", model.norm, model.cfg.depth
    kind, j = reader.split(".")
    j = int(j)
    block = model.blocks[j]
    if kind == "attn":
        entering = f"blocks.{j - 1}.resid2"
        return f"blocks.{j}.norm1", entering, block.norm1, j
    return f"blocks.{j}.norm2", f"blocks.{j}.resid1", block.norm2, j


def head_writes(model, z: torch.Tensor, block: int) -> torch.Tensor:
    """What each head of ``block`` writes at the class token: (B, heads, D)."""
    b = model.blocks[block]
    heads, d = z.shape[-2:]
    weight = b.attn.out_proj.weight  # (D, heads * d)
    out = torch.stack([z[:, 0, h] @ weight[:, h * d : (h + 1) * d].T for h in range(heads)], dim=1)
    return out * b.ls1.gamma if hasattr(b.ls1, "gamma") else out


def _ld(logits: torch.Tensor, y: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0]


def _entering(cache, first: str, j: int) -> torch.Tensor:
    return cache[first] if j == 0 else cache[f"blocks.{j - 1}.resid2"]


def edge_patch_batch(model, x_clean, x_corrupt, y, contrast) -> dict[str, np.ndarray]:
    """Every edge of one batch, denoising: ``edge_exact_ld`` and ``edge_atp_ld`` (B, edges): the
    patched run's logit difference minus the corrupted run's, exact and estimated."""
    if model.training:
        raise InterventionError(
            "edge patching measures the trained function: call model.eval() first"
        )
    found = edges(model)
    first = "norm_pre" if model.cfg.norm_pre else "pos_add"
    with torch.no_grad():
        _, clean = run_with_cache(model, x_clean)
        corrupt_logits, corr = run_with_cache(model, x_corrupt)
    base = _ld(corrupt_logits, y, contrast)
    deltas = {
        i: (
            head_writes(model, clean[f"blocks.{i}.attn.z"], i)
            - head_writes(model, corr[f"blocks.{i}.attn.z"], i)
        )
        for i in range(model.cfg.depth)
    }
    grads = _reader_gradients(model, x_corrupt, y, contrast, {e.reader for e in found}, corr)
    exact = np.zeros((len(y), len(found)), dtype=np.float32)
    atp = np.zeros_like(exact)
    with torch.no_grad():
        for k, e in enumerate(found):
            delta = deltas[e.block][:, e.head]  # (B, D)
            point, key, norm, start = _reader_points(model, e.reader)
            moved = norm(corr[key][:, 0] + delta)

            def replace(a, moved=moved):
                a = a.clone()
                a[:, 0] = moved
                return a

            with attached(model, [(point, replace)]):
                if e.reader == "readout":
                    logits = model.forward_head(replace(corr["norm"]))
                else:
                    logits = model.forward_head(
                        model.forward_blocks(_entering(corr, first, start), start)
                    )
            exact[:, k] = (_ld(logits, y, contrast) - base).numpy()
            atp[:, k] = (grads[e.reader] * delta).sum(-1).numpy()
    return {"edge_exact_ld": exact, "edge_atp_ld": atp}


def _reader_gradients(model, x, y, contrast, readers, corr) -> dict[str, torch.Tensor]:
    """Per reader, the gradient of the summed logit difference with respect to its input at the
    class token (B, D), on the run ``corr`` cached: the gradient at the norm's output, pulled back
    through the norm at that input."""
    held: dict[str, torch.Tensor] = {}
    hooks = []
    for reader in sorted(readers):
        point = _reader_points(model, reader)[0]

        def keep(a, reader=reader):
            held[reader] = a
            return a

        hooks.append((point, keep))
    names = sorted(readers)
    with torch.enable_grad():
        with attached(model, hooks):
            metric = _ld(model(x), y, contrast).sum()
        at_outputs = torch.autograd.grad(metric, [held[r] for r in names])  # no parameter grads
        out = {}
        for reader, grad in zip(names, at_outputs):
            _, key, norm, _ = _reader_points(model, reader)
            x_in = corr[key][:, 0].detach().requires_grad_(True)
            (g,) = torch.autograd.grad(norm(x_in), x_in, grad[:, 0])
            out[reader] = g.detach()
    return out


def edge_passes(model) -> dict[str, int]:
    """Forwards and backwards per pair batch: exact, one partial forward per edge after the two
    runs; AtP, one forward and backward of the corrupted run (the clean run is shared)."""
    n = len(edges(model))
    return {"exact_forward": 2 + n, "atp_forward": 3, "atp_backward": 1}


def edge_patch_split(model, images, labels, indices, inputs, spec) -> dict[str, np.ndarray]:
    """Every edge on the protocol's pairs (``patching.split_pairs``: the pairs the exact grid
    patches), batched as ``inputs`` says: the per-pair arrays of ``edge_patch_batch``, the edges'
    labels, the passes per pair batch (exact forwards, AtP forwards, AtP backwards) and the wall
    time of each method."""
    from workbench.interventions.patching import corrupt, split_pairs

    pairs = split_pairs(labels.cpu().numpy(), indices.cpu().numpy(), spec, model.cfg.num_patches)
    clean_idx, source_idx = torch.from_numpy(pairs.clean), torch.from_numpy(pairs.source)
    y_all, contrast_all = labels[clean_idx], labels[source_idx]
    parts, done, started = [], 0, time.perf_counter()
    with inputs.autocast():
        for clean, source in zip(
            inputs.loader(images[clean_idx], y_all), inputs.loader(images[source_idx], contrast_all)
        ):
            b = len(clean.labels)
            x_corrupt = corrupt(
                clean.images, source.images, pairs.replaced[done : done + b], model.cfg
            )
            parts.append(
                edge_patch_batch(model, clean.images, x_corrupt, clean.labels, source.labels)
            )
            done += b
    passes = edge_passes(model)
    return {
        "edge_exact_ld": np.concatenate([p["edge_exact_ld"] for p in parts]),
        "edge_atp_ld": np.concatenate([p["edge_atp_ld"] for p in parts]),
        "edge_labels": np.array([e.label for e in edges(model)]),
        "edge_passes": np.array(
            [passes["exact_forward"], passes["atp_forward"], passes["atp_backward"]]
        ),
        "edge_seconds": np.array(time.perf_counter() - started),
    }


def edge_agreement(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """Edge AtP against exact path patching over the edges, from the mean change per edge:
    Spearman rho, the share with the same sign, and the overlap of the ten largest (by size)."""
    from scipy import stats as sps

    exact = arrays["edge_exact_ld"].astype(np.float64).mean(axis=0)
    atp = arrays["edge_atp_ld"].astype(np.float64).mean(axis=0)
    k = min(10, len(exact))
    top = lambda v: set(np.argsort(-np.abs(v))[:k].tolist())  # noqa: E731
    return {
        "edges_rho": float(sps.spearmanr(exact, atp).statistic),
        "edges_sign_agreement": float(np.mean(np.sign(exact) == np.sign(atp))),
        "edges_top10_overlap": len(top(exact) & top(atp)) / k,
        "edges": float(len(exact)),
    }
