"""Which clean images activation patching pairs: a class-stratified sample, and the old rule kept for frozen protocols."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pytest
import yaml

from workbench.data import prepare
from workbench.data.errors import DatasetNotFound
from workbench.interventions import InterventionError
from workbench.interventions.patching import make_pairs
from workbench.protocol import load_intervention_protocol, parse_intervention_protocol
from workbench.protocol.intervention import UNIFORM_PAIRS_PROTOCOLS

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = ROOT / "studies" / "protocols"
PUBLISHED = ROOT / "docs" / "results" / "fmnist_seed_recipe_patching" / "evidence" / "patching"


def old_make_pairs(labels: np.ndarray, count: int, seed: int):
    """The pairs as ``make_pairs`` drew them before the stratified sample (copied from that commit)."""
    rng = np.random.default_rng(seed)
    clean = np.sort(rng.choice(len(labels), size=count, replace=False))
    source = np.array([rng.choice(np.flatnonzero(labels != labels[c])) for c in clean])
    return clean, source


def class_ordered(per_class: int = 50, classes: int = 10) -> np.ndarray:
    """A split stored by class, as CIFAR-10's JPEG copy is: 0 0 ... 1 1 ... 9 9."""
    return np.repeat(np.arange(classes), per_class)


def test_the_uniform_rule_is_the_old_draw_bit_for_bit():
    labels = np.random.default_rng(7).integers(0, 10, size=800)
    for count, seed in ((256, 0), (32, 0), (17, 5)):
        clean, source = old_make_pairs(labels, count, seed)
        pairs = make_pairs(labels, count, seed, sample="uniform")
        assert np.array_equal(pairs.clean, clean), (count, seed)
        assert np.array_equal(pairs.source, source), (count, seed)


def test_on_a_class_ordered_split_the_stratified_pairs_give_every_class_its_share():
    labels, keys = class_ordered(), np.arange(10_000, 10_500)
    pairs = make_pairs(labels, 40, 3, sample="stratified", keys=keys)
    counts = np.bincount(labels[pairs.clean], minlength=10)
    assert np.array_equal(counts, np.full(10, 4)), counts
    assert np.all(labels[pairs.source] != labels[pairs.clean])
    again = make_pairs(labels, 40, 3, sample="stratified", keys=keys)
    assert np.array_equal(again.clean, pairs.clean) and np.array_equal(again.source, pairs.source)
    # the first-N reading of such a split (what a "first 40" would score) is one class only, and
    # a uniform draw of 40 leaves the counts uneven: the new rule is what makes them equal
    assert np.count_nonzero(np.bincount(labels[:40], minlength=10)) == 1
    uniform = np.bincount(labels[make_pairs(labels, 40, 3, sample="uniform").clean], minlength=10)
    assert uniform.max() - uniform.min() > 1, uniform


def test_an_unknown_sample_rule_is_refused():
    with pytest.raises(InterventionError, match="sample 'first': must be one of stratified"):
        make_pairs(class_ordered(), 4, 0, sample="first")


def _patching_files() -> list[Path]:
    return sorted(p for p in PROTOCOLS.glob("*.yaml") if "\npatching:" in p.read_text())


def test_every_protocol_frozen_with_patching_keeps_its_hash_and_the_uniform_draw():
    files = _patching_files()
    assert files, "no protocol with a patching section"
    frozen = {}
    for path in files:
        protocol = load_intervention_protocol(path)
        if protocol.hash in UNIFORM_PAIRS_PROTOCOLS:  # frozen before the key: the old draw
            frozen[protocol.hash] = protocol.name
            assert protocol.patching.sample == "uniform", path.name
            assert "sample" not in protocol.canonical["patching"], path.name
        else:  # written after it (fmnist_seed_recipe_atp, smoke_atp): stratified, and hashed so
            assert protocol.patching.sample == "stratified", path.name
            assert protocol.canonical["patching"]["sample"] == "stratified", path.name
    assert frozen == UNIFORM_PAIRS_PROTOCOLS, "every pinned uniform-pairs protocol is still shipped"


def test_a_new_protocol_draws_stratified_pairs_and_its_hash_says_so():
    path = PROTOCOLS / "smoke_patching.yaml"
    data = yaml.safe_load(path.read_text())
    data["description"] += " A new protocol."
    new = parse_intervention_protocol(data, str(path))
    assert new.patching.sample == "stratified"
    assert new.canonical["patching"]["sample"] == "stratified"
    said = parse_intervention_protocol(
        {**data, "patching": {**data["patching"], "sample": "stratified"}}, str(path)
    )
    assert said.hash == new.hash
    # naming the old rule gives the old canonical form: a frozen file with the key written out
    old = yaml.safe_load(path.read_text())
    named = parse_intervention_protocol(
        {**old, "patching": {**old["patching"], "sample": "uniform"}}, str(path)
    )
    assert named.hash == load_intervention_protocol(path).hash
    with pytest.raises(
        Exception, match="patching.sample='first': expected 'stratified' or 'uniform'"
    ):
        parse_intervention_protocol(
            {**data, "patching": {**data["patching"], "sample": "first"}}, str(path)
        )


def test_the_published_patching_study_still_draws_the_pairs_it_published():
    protocol = load_intervention_protocol(PROTOCOLS / "fmnist_seed_recipe_patching.yaml")
    spec = protocol.source.dataset
    try:
        data = prepare(
            spec.name,
            path=spec.path,
            split_seed=spec.split_seed,
            train_size=spec.train_size,
            val_size=spec.val_size,
            subset=spec.subset,
        )
    except DatasetNotFound as err:  # the Debian package dataset-fashion-mnist is not installed
        pytest.skip(f"Fashion-MNIST not found: {err}")
    labels, indices = data.val.labels.numpy(), data.val.indices.numpy()
    p = protocol.patching
    pairs = make_pairs(labels, p.pairs, p.seed, corruption=p.corruption, sample=p.sample)
    for f in sorted(PUBLISHED.glob("*.npz.gz")):
        with np.load(io.BytesIO(gzip.decompress(f.read_bytes()))) as z:
            for key, drawn in (("clean_index", pairs.clean), ("source_index", pairs.source)):
                published = z[key]
                differ = np.flatnonzero(indices[drawn] != published)
                assert len(published) == p.pairs and not len(differ), (
                    f"{f.name} {key}: {len(differ)} of {len(published)} differ"
                )
