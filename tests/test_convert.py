"""Strict weight mapping, unsupported-option refusals and safe checkpoint loading."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

from workbench.convert import checkpoints
from workbench.convert.checkpoints import (
    CheckpointError,
    PinnedCheckpoint,
    load_state_dict_file,
    read_lock,
    write_lock,
)
from workbench.convert.timm_weights import load_timm_weights
from workbench.convert.timm_vit import (
    UnsupportedTimmModel,
    WeightMappingError,
    config_from_timm,
    map_timm_state_dict,
)
from workbench.models.registry import UnknownModel


@pytest.fixture(scope="module")
def tiny_timm():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()


def test_mapping_uses_every_tensor_once(tiny_timm):
    cfg = config_from_timm(tiny_timm)
    mapped, audit = map_timm_state_dict(tiny_timm.state_dict(), cfg)
    assert (audit.source_used, audit.source_tensors, audit.target_filled, audit.target_tensors) == (
        152,
        152,
        152,
        152,
    )
    assert audit.parameters == sum(p.numel() for p in tiny_timm.parameters())
    assert mapped["patch_proj.weight"] is tiny_timm.state_dict()[
        "patch_embed.proj.weight"
    ] or torch.equal(mapped["patch_proj.weight"], tiny_timm.state_dict()["patch_embed.proj.weight"])
    assert torch.equal(
        mapped["blocks.3.attn.out_proj.bias"], tiny_timm.state_dict()["blocks.3.attn.proj.bias"]
    )


def test_missing_extra_and_misshaped_keys_are_all_named(tiny_timm):
    cfg = config_from_timm(tiny_timm)
    state = dict(tiny_timm.state_dict())
    del state["blocks.5.norm2.weight"]
    state["dist_token"] = torch.zeros(1, 1, 192)
    state["head.weight"] = torch.zeros(10, 192)
    with pytest.raises(WeightMappingError) as err:
        map_timm_state_dict(state, cfg)
    message = str(err.value)
    assert "missing key: blocks.5.norm2.weight" in message
    assert "unexpected key: dist_token [1, 1, 192]" in message
    assert "head.weight: checkpoint [10, 192] vs model [1000, 192]" in message


@pytest.mark.parametrize(
    "name, kwargs, option",
    [
        ("vit_small_patch16_18x2_224", {}, "block_fn=ParallelThingsBlock"),
        ("vit_tiny_patch16_224", {"dynamic_img_size": True}, "dynamic_img_size=True"),
        ("deit_tiny_distilled_patch16_224", {}, "VisionTransformerDistilled"),
        ("vit_tiny_r_s16_p8_224", {}, "HybridEmbed patch embedding"),
    ],
)
def test_unsupported_timm_options_are_refused_by_name(name, kwargs, option):
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    with pytest.raises(UnsupportedTimmModel, match=option.replace("(", r"\(").replace(")", r"\)")):
        config_from_timm(model)


def test_unknown_model_name_lists_the_options():
    with pytest.raises(UnknownModel) as err:
        load_timm_weights("vit_gigantic_banana")
    message = str(err.value)
    assert "vit_base_patch16_224" in message and "any timm ViT architecture" in message
    # A timm ViT is asked for here: no study model and no timm/<name> arm is suggested, since neither is taken.
    assert "fmnist_vit" not in message and "timm/" not in message, message
    assert "vit_small_patch14_dinov2.lvd142m" in message  # pinned checkpoint names are listed


def test_family_config_is_read_off_the_modules():
    with torch.device("meta"):
        clip = config_from_timm(timm.create_model("vit_base_patch16_clip_quickgelu_224"))
        dino = config_from_timm(timm.create_model("vit_small_patch14_reg4_dinov2"))
        siglip = config_from_timm(timm.create_model("vit_base_patch16_siglip_224"))
    assert (clip.norm_pre, clip.patch_bias, clip.act, clip.layer_norm_eps) == (
        True,
        False,
        "quick_gelu",
        1e-5,
    )
    assert (dino.layer_scale_init, dino.register_tokens, dino.num_classes, dino.image_size) == (
        1e-5,
        4,
        0,
        518,
    )
    assert (siglip.pooling, siglip.class_token, siglip.num_classes) == ("map", False, 0)


def test_local_safetensors_checkpoint_loads_and_records_sha(tmp_path, tiny_timm):
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_timm.state_dict().items()}, str(path))
    # a folder works too
    loaded = load_timm_weights("vit_tiny_patch16_224", str(tmp_path), seed=123)
    assert loaded.pretrained and loaded.source == "local"
    assert loaded.sha256 == checkpoints.sha256_file(path)
    for key, value in tiny_timm.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[key], value), key


def test_sha_mismatch_is_refused_with_expected_and_actual(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3)}, str(path))
    with pytest.raises(
        CheckpointError,
        match=r"sha256 mismatch for .*w\.safetensors: expected 0{64}, actual [0-9a-f]{64}",
    ):
        load_state_dict_file(path, expected_sha256="0" * 64)


def test_pinned_name_with_wrong_local_file_is_refused(tmp_path, monkeypatch, tiny_timm):
    lock = tmp_path / "lock.json"
    write_lock(
        {
            "tiny.pinned": PinnedCheckpoint(
                "tiny.pinned",
                "vit_tiny_patch16_224",
                "timm/x",
                "model.safetensors",
                "abc123",
                10,
                "f" * 64,
            )
        },
        lock,
    )
    monkeypatch.setattr(checkpoints, "LOCK_PATH", lock)
    monkeypatch.setattr("workbench.convert.timm_weights.read_lock", lambda: read_lock(lock))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_timm.state_dict().items()}, str(path))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_timm_weights("tiny.pinned", str(path))


def test_unpinned_hub_checkpoint_is_refused_before_any_download():
    name = "vit_base_patch16_224.augreg_in21k_ft_in1k"
    entry = read_lock()[name]
    assert entry.hub_repo == f"timm/{name}" and entry.filename == "model.safetensors"
    if entry.is_pinned:
        pytest.skip("lock entry is pinned in this checkout")
    with pytest.raises(CheckpointError, match="no pinned revision/sha256.*workbench pin"):
        load_timm_weights(name, "hub")


class NeedsCode:
    """Pickling an instance of this class stores a reference to code."""


def test_pickle_needing_code_execution_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": NeedsCode()}, path)
    with pytest.raises(CheckpointError, match=r"refused .*evil\.pt.*needs code execution"):
        load_state_dict_file(path)


def test_weights_only_torch_file_is_accepted(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"weight": torch.arange(4.0)}, path)
    state, _ = load_state_dict_file(path)
    assert torch.equal(state["weight"], torch.arange(4.0))


def test_truncated_safetensors_file_is_refused_by_name(tmp_path, tiny_timm):
    path = tmp_path / "cut.safetensors"
    save_file({"pos_embed": tiny_timm.state_dict()["pos_embed"].contiguous()}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"corrupted or truncated safetensors file .*cut\.safetensors"
    ):
        load_state_dict_file(path)


def test_lock_file_write_is_atomic_and_roundtrips(tmp_path):
    lock = tmp_path / "lock.json"
    entry = PinnedCheckpoint(
        "n", "vit_tiny_patch16_224", "timm/n", "model.safetensors", "rev", 5, "a" * 64
    )
    write_lock({"n": entry}, lock)
    assert read_lock(lock)["n"] == entry
    assert json.loads(lock.read_text())["checkpoints"]["n"]["sha256"] == "a" * 64
    assert not list(tmp_path.glob(".*tmp"))  # no temp files left behind


class FakeHub:
    """Stands in for huggingface_hub.HfApi: one repo whose LFS file has a known size and sha256."""

    def __init__(self, repo: str, filename: str, size: int, sha: str) -> None:
        from types import SimpleNamespace

        lfs = SimpleNamespace(size=size, sha256=sha)
        self.info = SimpleNamespace(
            sha="0123abc" * 5 + "01234", siblings=[SimpleNamespace(rfilename=filename, lfs=lfs)]
        )
        self.repo = repo

    def model_info(self, repo, files_metadata=False):
        assert repo == self.repo, repo
        return self.info


def test_pin_and_load_a_dinov2_checkpoint_with_a_fake_hub(tmp_path, monkeypatch):
    """`workbench pin` records revision, size and sha256 for a new-family entry; loading then
    verifies the file against them and the glass-box model takes the weights."""
    name = "vit_small_patch14_dinov2.lvd142m"
    lock = tmp_path / "lock.json"
    write_lock(read_lock(), lock)
    assert {name, "vit_base_patch16_clip_224.openai"} <= set(read_lock(lock))
    assert not read_lock(lock)[name].is_pinned

    torch.manual_seed(0)
    source = timm.create_model(name, pretrained=False)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    sha = checkpoints.sha256_file(path)
    monkeypatch.setattr(
        "huggingface_hub.HfApi",
        lambda: FakeHub(f"timm/{name}", "model.safetensors", path.stat().st_size, sha),
    )
    entry = checkpoints.pin_checkpoint(name, lock)
    assert entry.is_pinned and entry.sha256 == sha and entry.size_bytes == path.stat().st_size
    assert read_lock(lock)[name] == entry

    monkeypatch.setattr("workbench.convert.timm_weights.read_lock", lambda: read_lock(lock))
    monkeypatch.setattr("workbench.convert.timm_weights.download_pinned", lambda e: path)
    loaded = load_timm_weights(name, "hub")
    assert (
        loaded.pretrained
        and loaded.sha256 == sha
        and loaded.architecture == "vit_small_patch14_dinov2"
    )
    cfg = config_from_timm(loaded.model)
    assert (cfg.num_classes, cfg.layer_scale_init, cfg.image_size) == (0, 1e-5, 518)

    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)  # a different file under the same name
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_timm_weights(name, "hub")
