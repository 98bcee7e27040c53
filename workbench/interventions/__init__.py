"""Causal interventions on the glass-box ViT, in the analysis mode's stage vocabulary.

The model itself is never changed (``workbench/models`` is the code fingerprint of every
trained cell): interventions act on an unmodified ``VisionTransformer`` through a forward
written from its own submodules (``forward``), hooks that live for one call, and small
frozen values (``spec``)::

    from workbench.interventions import HeadAblation, SkipBranch, head_means, run

    model.eval()
    intact = run(model, x)                                    # model(x) itself: nothing hooked
    no_head = run(model, x, [HeadAblation(block=1, head=2)])  # zero-ablated head
    means = head_means(model, reference_batches)
    mean_head = run(model, x, [HeadAblation(1, 2, "mean")], head_means=means)
    no_mlp = run(model, x, [SkipBranch(0, "mlp")])

See docs/interventions.md.
"""

from workbench.interventions.cache import (
    as_glassbox,
    hook_name,
    hook_path,
    logit_lens,
    run_with_cache,
    run_with_hooks,
)
from workbench.interventions.forward import HeadMeans, capture, head_means, run
from workbench.models.activation_cache import ActivationCache
from workbench.models.hooks import HookError, hook_paths
from workbench.interventions.spec import (
    DropTokens,
    HeadAblation,
    Intervention,
    InterventionError,
    InterventionSet,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
    check,
    flatten,
    parse,
    patchable_stages,
)

__all__ = [
    "ActivationCache",
    "as_glassbox",
    "hook_name",
    "hook_path",
    "hook_paths",
    "logit_lens",
    "HookError",
    "run_with_cache",
    "run_with_hooks",
    "DropTokens",
    "HeadAblation",
    "HeadMeans",
    "Intervention",
    "InterventionError",
    "InterventionSet",
    "PatchStage",
    "SkipBranch",
    "ZeroPosEmbed",
    "capture",
    "check",
    "flatten",
    "head_means",
    "parse",
    "patchable_stages",
    "run",
]
