"""TensorLoader order, batched augmentation, resume, evaluation batches and resizing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from data_fixtures import max_diff

from workbench.data import (
    AugmentConfig,
    NormStats,
    TensorLoader,
    augment_batch,
    resize_batch,
    sample_params,
)
from workbench.data.augment import affine_grid, affine_matrices, crop_flip

N, C, H, W = 100, 3, 16, 16
NORM = NormStats((0.5, 0.4, 0.3), (0.25, 0.2, 0.3))
FULL_AUG = AugmentConfig(crop_padding=2, hflip=True, rotate_degrees=5, translate_fraction=0.06)


def _data(n=N, c=C, h=H, w=W, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)
    labels = torch.arange(n) % 10
    return images, labels, torch.arange(1000, 1000 + n)  # dataset positions differ from rows


def _loader(augment=FULL_AUG, seed=0, **kw):
    images, labels, indices = _data()
    kw.setdefault("batch_size", 32)
    return TensorLoader(
        images, labels, indices, norm=NORM, seed=seed, augment=augment, device="cpu", **kw
    )


def _normalized(images):
    mean = torch.tensor(NORM.mean).view(1, -1, 1, 1)
    std = torch.tensor(NORM.std).view(1, -1, 1, 1)
    return (images.float() / 255 - mean) / std


def test_len_and_drop_last():
    assert len(_loader()) == 4 and [len(b.labels) for b in _loader().iter_epoch(0)] == [
        32,
        32,
        32,
        4,
    ]
    assert (
        len(_loader(drop_last=True)) == 3 and len(list(_loader(drop_last=True).iter_epoch(0))) == 3
    )


def test_eval_loader_returns_normalized_originals_in_order():
    images, labels, indices = _data()
    loader = TensorLoader(
        images, labels, indices, batch_size=32, norm=NORM, shuffle=False, device="cpu"
    )
    batches = list(loader)
    got = torch.cat([b.images for b in batches])
    diff = max_diff(got, _normalized(images))
    assert diff <= 1e-6, f"eval images differ from normalised originals by {diff}"
    assert torch.equal(torch.cat([b.indices for b in batches]), indices)
    assert torch.equal(torch.cat([b.labels for b in batches]), labels)


def test_order_depends_only_on_seed_and_epoch():
    plain, augmented = _loader(augment=None), _loader(augment=FULL_AUG)
    for epoch in (0, 1):  # every arm of a seed sees the same order, whatever it augments
        a = torch.cat([b.indices for b in plain.iter_epoch(epoch)])
        b = torch.cat([b.indices for b in augmented.iter_epoch(epoch)])
        assert torch.equal(a, b)
        assert sorted(a.tolist()) == list(range(1000, 1000 + N)), "each epoch is a permutation"
    e0, e1 = plain.order(0), plain.order(1)
    assert not torch.equal(e0, e1) and not torch.equal(e0, _loader(augment=None, seed=1).order(0))


def test_augmentation_is_deterministic_per_seed_epoch_batch():
    first = [b.images for b in _loader().iter_epoch(2)]
    second = [b.images for b in _loader().iter_epoch(2)]
    for k, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"batch {k} differs on repeat: max |diff| {max_diff(a, b)}"
    other_seed = next(iter(_loader(seed=1).iter_epoch(2))).images
    assert max_diff(first[0], other_seed) > 0.1


def test_same_images_get_different_augmentation_in_other_epochs_and_batches():
    images, labels, _ = _data()
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = augment_batch(images, FULL_AUG, sample_params(FULL_AUG, N, g(1)))
    b = augment_batch(images, FULL_AUG, sample_params(FULL_AUG, N, g(2)))
    assert max_diff(a, b) > 0.1
    plain = TensorLoader(
        images, labels, batch_size=N, norm=NORM, shuffle=False, augment=FULL_AUG, device="cpu"
    )
    e0, e1 = next(plain.iter_epoch(0)).images, next(plain.iter_epoch(1)).images
    assert max_diff(e0, e1) > 0.1, "augmentation must change between epochs"


def test_resume_at_batch_k_equals_tail_of_full_epoch():
    loader = _loader()
    full = list(loader.iter_epoch(5))
    for k in (0, 1, 3, 4):
        tail = list(_loader().iter_epoch(5, start_batch=k))
        assert len(tail) == len(full) - k
        for j, (got, want) in enumerate(zip(tail, full[k:])):
            assert torch.equal(got.indices, want.indices)
            diff = max_diff(got.images, want.images)
            assert torch.equal(got.images, want.images), f"batch {k + j}: max |diff| {diff}"
    with pytest.raises(ValueError, match="start_batch must be in"):
        next(loader.iter_epoch(0, start_batch=5))


def test_set_epoch_drives_iter():
    loader = _loader(augment=None)
    loader.set_epoch(3)
    assert torch.equal(next(iter(loader)).indices, next(loader.iter_epoch(3)).indices)


# ---------------------------------------------------------------- augmentation ops vs references


def test_crop_flip_matches_per_image_reference():
    images, _, _ = _data(n=8, h=12, w=20)
    g = torch.Generator().manual_seed(0)
    offsets, flip = torch.randint(0, 5, (8, 2), generator=g), torch.rand(8, generator=g) < 0.5
    got = crop_flip(images, 2, offsets, flip)
    padded = F.pad(images, (2, 2, 2, 2))
    want = [padded[i, :, r : r + 12, c : c + 20] for i, (r, c) in enumerate(offsets.tolist())]
    want = torch.stack([im.flip(-1) if f else im for im, f in zip(want, flip)])
    assert torch.equal(got, want), f"max |diff| {max_diff(got, want)}"


def test_affine_grid_matches_torch():
    theta = affine_matrices(
        torch.tensor([3.0, -5.0]), torch.tensor([[0.05, -0.02], [0.0, 0.06]]), 12, 20
    )
    want = F.affine_grid(theta, [2, 3, 12, 20], align_corners=False)
    diff = max_diff(affine_grid(theta, 12, 20), want)
    assert diff <= 1e-6, f"grid differs from F.affine_grid by {diff}"


def test_flip_only_flips_the_drawn_images():
    images, _, _ = _data(n=64)
    cfg = AugmentConfig(hflip=True)
    params = sample_params(cfg, 64, torch.Generator().manual_seed(0))
    got = augment_batch(images, cfg, params)
    want = (
        torch.stack([im.flip(-1) if f else im for im, f in zip(images, params["flip"])]).float()
        / 255
    )
    assert 16 <= int(params["flip"].sum()) <= 48
    assert torch.equal(got, want)


def _affine(images, angle, shift):
    cfg = AugmentConfig(rotate_degrees=90, translate_fraction=0.49)
    n = len(images)
    params = {
        "crop": torch.zeros(n, 2, dtype=torch.long),
        "flip": torch.zeros(n, dtype=torch.bool),
        "angle": torch.full((n,), float(angle)),
        "shift": torch.tensor([shift] * n, dtype=torch.float),
    }
    return augment_batch(images, cfg, params)


def test_affine_identity_and_integer_shift_are_exact():
    images, _, _ = _data(n=4, h=12, w=20)  # non-square on purpose
    x = images.float() / 255
    diff = max_diff(_affine(images, 0, (0.0, 0.0)), x)
    assert diff <= 1e-5, f"identity affine changed pixels by {diff}"
    shifted = _affine(images, 0, (2 / 20, -1 / 12))  # 2 px right, 1 px up
    want = torch.zeros_like(x)
    want[:, :, :-1, 2:] = x[:, :, 1:, :-2]
    diff = max_diff(shifted, want)
    assert diff <= 1e-5, f"integer shift differs from a pixel roll by {diff}"


def test_affine_rotation_by_90_degrees_is_a_pixel_rotation():
    images, _, _ = _data(n=4)
    got = _affine(images, 90, (0.0, 0.0))
    # +angle turns the picture clockwise as displayed (image rows grow downwards).
    want = torch.rot90(images.float() / 255, k=-1, dims=(2, 3))
    diff = max_diff(got, want)
    assert diff <= 1e-5, f"90 degree rotation differs from rot90 by {diff}"


def test_sampled_params_stay_in_range():
    params = sample_params(FULL_AUG, 4096, torch.Generator().manual_seed(0))
    assert params["crop"].min() >= 0 and params["crop"].max() <= 4
    assert params["angle"].abs().max() <= 5 and params["angle"].abs().max() > 4.9
    assert params["shift"].abs().max() <= 0.06


# fmt: skip
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"crop_padding": -1}, "crop_padding"),
        ({"crop_padding": 1.5}, "crop_padding"),
        ({"hflip": 1}, "hflip"),
        ({"rotate_degrees": -1}, "rotate_degrees"),
        ({"translate_fraction": 0.5}, "translate_fraction"),
    ],
)
def test_augment_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AugmentConfig(**kwargs)


# ---------------------------------------------------------------- resizing and channels


def test_resize_batch():
    images, _, _ = _data(n=2, h=28, w=28)
    up = resize_batch(images, 224)
    assert up.shape == (2, 3, 224, 224) and up.dtype == torch.float32
    const = torch.full((1, 3, 28, 28), 77, dtype=torch.uint8)
    assert max_diff(resize_batch(const, 224), torch.full((1, 3, 224, 224), 77 / 255)) <= 1e-6
    x = images.float() / 255
    down = resize_batch(x, 14)
    want = F.interpolate(x, size=(14, 14), mode="bilinear", align_corners=False, antialias=True)
    assert max_diff(down, want) == 0.0
    assert resize_batch(x, 28) is x


def test_loader_resize_and_to_rgb():
    images = torch.randint(0, 256, (10, 1, 28, 28), dtype=torch.uint8)
    labels = torch.zeros(10, dtype=torch.long)
    imagenet = NormStats((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    loader = TensorLoader(images, labels, batch_size=4, norm=imagenet, shuffle=False, resize_to=32,
                          to_rgb=True, device="cpu")  # fmt: skip
    batch = next(iter(loader))
    assert batch.images.shape == (4, 3, 32, 32)
    with pytest.raises(ValueError, match="norm has 3 channels but batches will have 1"):
        TensorLoader(images, labels, batch_size=4, norm=imagenet, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_match_cpu():
    cpu = [b.images for b in _loader().iter_epoch(1)]
    images, labels, indices = _data()
    gpu = TensorLoader(images, labels, indices, batch_size=32, norm=NORM, seed=0, augment=FULL_AUG,
                       device="cuda")  # fmt: skip
    for k, (a, b) in enumerate(zip(cpu, gpu.iter_epoch(1))):
        assert b.images.is_cuda
        diff = max_diff(a, b.images.cpu())
        assert diff <= 1e-4, f"batch {k}: CUDA vs CPU max |diff| {diff}"
