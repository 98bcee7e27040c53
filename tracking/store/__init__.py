"""Where runs go: the configured store, the offline fallback, and what keeps a store sound.

- ``uris``: the configured tracking URI, how it is shown, the process's URI;
- ``session``: ``configure_tracking`` and ``start_run``, the one place that decides where runs go;
- ``health``: an unreachable server told apart from refused credentials, probes, retries;
- ``offline_store``: the local fallback store while a server is away;
- ``store_lock``: one writer at a time for find-or-create on a local SQLite store;
- ``store_errors``: one line for a database error; ``storage_guard``: Optuna never in MLflow's database;
- ``redact``: no secret reaches a record; ``ui_links``: MLflow UI addresses to print.
"""
