"""Published pages name paths as the user gave them: relative to the folder the report was built from."""

from __future__ import annotations

from tracking.record import queries
from workbench.text.portable import portable_text


def test_published_pages_name_paths_as_given_relative_to_the_build_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = {
        f"sqlite:///{tmp_path}/stores/x.db": "sqlite:///stores/x.db",  # sqlite:////abs -> sqlite:///rel
        "sqlite:///stores/x.db": "sqlite:///stores/x.db",  # given relative: unchanged
        f"sqlite:///{tmp_path.parent}/other/x.db": "sqlite:///../other/x.db",  # outside: a ../ path
        f"file://{tmp_path}/mlruns": "mlruns",
        "https://mlflow.example.org:5000/": "https://mlflow.example.org:5000/",
        f"CIFAR-10 from {tmp_path}/data/c.tar.gz [JPEG]": "CIFAR-10 from data/c.tar.gz [JPEG]",
        "images/s, 12/01, a/b and (1/2)": "images/s, 12/01, a/b and (1/2)",
        # a Debian package's files are where they are on every machine: not ../../usr/share
        "Fashion-MNIST from /usr/share/datasets/fashion-mnist [official IDX files]": "Fashion-MNIST from /usr/share/datasets/fashion-mnist [official IDX files]",
    }
    for given, shown in cases.items():
        assert portable_text(given) == shown, given
        assert portable_text(shown) == shown, "rewriting twice changes nothing"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/stores/x.db")
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "x.db").touch()
    monkeypatch.setattr("tracking.store.uris.set_process_uri", lambda uri: None)
    assert queries.tracking_uri() == "sqlite:///stores/x.db"
