"""The shared MLflow tracking server: PostgreSQL backend, proxied artifacts, basic-auth (docs/server.md).

``server_config`` builds the ``mlflow server`` command and its environment, ``server_process``
runs it so that it fails loudly and leaves nothing behind (``server_watchdog`` is the script
that stops it when its launcher dies), ``server_users`` administers users and grants.
"""
