"""Ablation studies: arms x seeds trained from scratch (``workbench ablate``) and what drives them.

``ablate`` runs a protocol's cells (``train`` trains one), ``jobs`` runs several at once through the
``cell_queue`` (handed out longest first by ``cell_order``) that ``worker`` processes drain,
``status`` says where a study stands, ``sweep`` tunes one arm with Optuna.
"""
