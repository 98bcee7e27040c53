"""A stand-in for Colab's ``google.colab`` package, for executing notebooks/colab_t4.ipynb in tests.

Only what the notebook calls exists here: ``userdata.get`` (Colab secrets) and
``drive.mount`` (Google Drive). ``google/`` has no ``__init__.py`` on purpose: it stays a
namespace package, so ``google.protobuf`` (which MLflow imports) is still found.
"""
