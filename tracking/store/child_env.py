"""The environment of the processes the workbench starts: an allow-list, never "everything but".

A launcher's environment holds whatever its shell held: database URLs with passwords, an
unrelated ``DBPASS=...``, cloud keys. ``/proc/<pid>/environ`` shows a process's environment
to its user (and to root), and every process inherits it further. So each child gets only
what it needs, named here:

- every child: the basics of a process (``PATH``, ``HOME``, locale, temp folder, Python's
  own settings and virtual environment);
- ``ablate --jobs`` workers: also the workbench's client settings, each by its exact name
  (``WORKBENCH_CLIENT``), MLflow's client settings (the tracking server and its account),
  the libpq settings where a PostgreSQL queue or store is used
  (``PG*``: PostgreSQL reads its password from ``PGPASSWORD`` or ``PGPASSFILE``), TLS and proxy settings, the artifact stores' credentials (``AWS_*``,
  ...) and the torch / CUDA / thread settings; their queue URL comes as
  ``WORKBENCH_STORAGE``, never in argv;
- the ``mlflow server`` of ``workbench server start``: MLflow's server settings, TLS,
  proxies and the artifact stores' credentials; not the clients' tracking account, not
  the server launcher's own variables (admin password, database URIs with passwords);
- its watchdog (a standard-library script): the basics only;
- the ``git`` calls that read the checkout's commit: the basics and git's own settings.

libpq's settings (``PGPASSWORD``) reach a worker only where its queue or tracking store is
PostgreSQL.
"""

from __future__ import annotations

import os
from typing import Mapping

BASICS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP")
PYTHON = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED",
    "PYTHONWARNINGS",
    "PYTHONIOENCODING",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "COVERAGE_PROCESS_START",
)
NETWORK = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)
# Credentials MLflow's artifact clients read (boto3, azure, google-cloud) when artifacts are not proxied.
ARTIFACT_STORES = ("AWS_", "AZURE_STORAGE_", "GOOGLE_APPLICATION_CREDENTIALS")
COMPUTE = (
    "CUDA_",
    "CUBLAS_",
    "TORCH_",
    "OMP_",
    "MKL_",
    # the kernel caps (workbench/kernel_caps.py): a job's cells must run the kernels the
    # coordinator was capped to, ATen's and oneDNN's as well as MKL's
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_",
    "DNNL_",
    "OPENBLAS_",
    "KMP_",
    "HF_",
    "TIMM_",
    "XDG_CACHE_HOME",
)

# The workbench's own settings a worker reads, each by its exact name: a prefix would pass
# whatever else the coordinator's shell keeps under WORKBENCH_ (a queue URL with its password,
# a server's admin password) to every worker.
WORKBENCH_CLIENT = (
    "WORKBENCH_OFFLINE_DIR",
    "WORKBENCH_DATA_DIR",
    "WORKBENCH_CACHE_DIR",
    "WORKBENCH_USER",
    "WORKBENCH_DEBUG",
    "WORKBENCH_LEASE_SECONDS",
    "WORKBENCH_HEARTBEAT_SECONDS",
    "WORKBENCH_CLAIM_SETTLE_SECONDS",
    "WORKBENCH_STORE_LOCK_SECONDS",
    "WORKBENCH_HEALTH_TIMEOUT",
    "WORKBENCH_KERNEL_CAPS_APPLIED",
)

# Variables only `workbench server start` and its admin commands read; no worker needs them.
SERVER_LAUNCHER = (
    "WORKBENCH_SERVER_",
    "WORKBENCH_NEW_USER_PASSWORD",
    "MLFLOW_AUTH_ADMIN_PASSWORD",
    "MLFLOW_FLASK_SERVER_SECRET_KEY",
    "MLFLOW_BACKEND_STORE_URI",
    "MLFLOW_AUTH_CONFIG_PATH",
)
# A client's account on a tracking server: the server itself has no use for it.
TRACKING_CLIENT = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_",
)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """A pattern ending in ``_`` is a prefix; any other names one variable."""
    return any(name.startswith(p) if p.endswith("_") else name == p for p in patterns)


def allowed(
    allow: tuple[str, ...], deny: tuple[str, ...] = (), environ: Mapping[str, str] | None = None
) -> dict:
    """The variables of ``environ`` (default: this process's) that ``allow`` names and ``deny`` does not."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in environ.items()
        if (_matches(k, allow) or k.startswith("LC_")) and not _matches(k, deny)
    }


def worker_env(environ: Mapping[str, str] | None = None, storage: str = "") -> dict:
    """What a local ``workbench worker`` (``ablate --jobs``) needs from the coordinator's environment.

    libpq's settings (``PGPASSWORD`` among them) only where a PostgreSQL database is used: the
    worker's queue (``storage``) or its tracking store (MLFLOW_TRACKING_URI). A journal queue
    and a tracking server over HTTP need none of them.
    """
    environ = os.environ if environ is None else environ
    env = allowed(
        (*BASICS, *PYTHON, *NETWORK, *ARTIFACT_STORES, *COMPUTE, *WORKBENCH_CLIENT, "MLFLOW_"),
        SERVER_LAUNCHER,
        environ,
    )
    databases = (storage, environ.get("MLFLOW_TRACKING_URI", ""))
    return env | (_libpq(environ) if any(map(is_postgres, databases)) else {})


def is_postgres(url: str) -> bool:
    """Whether a queue or store URL names a PostgreSQL database (``postgresql://``, ``postgresql+psycopg2://``)."""
    return url.split(":", 1)[0].split("+", 1)[0] in ("postgresql", "postgres")


# What ``git rev-parse`` / ``git status`` read besides the basics: where the repository is and
# git's own configuration (``safe.directory`` given by GIT_CONFIG_* in containers), by exact name.
GIT = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
    "GIT_CONFIG_GLOBAL",
    "GIT_CONFIG_SYSTEM",
    "GIT_CONFIG_NOSYSTEM",
    "GIT_CONFIG_COUNT",
    "GIT_CONFIG_KEY_",
    "GIT_CONFIG_VALUE_",
    "GIT_CONFIG_PARAMETERS",
    "XDG_CONFIG_HOME",
)


def git_env(environ: Mapping[str, str] | None = None) -> dict:
    """The ``git`` calls that read a checkout's commit (``tracking.store.session.git_state``): the
    basics and git's own settings; no tracking account, database URL or queue URL."""
    return allowed((*BASICS, *GIT), (), environ)


def _libpq(environ: Mapping[str, str] | None) -> dict:
    """libpq's own settings (``PGPASSFILE``, ``PGPASSWORD``, ``PGSSLMODE``, ...): every name starts with PG."""
    environ = os.environ if environ is None else environ
    return {
        k: v for k, v in environ.items() if k.startswith("PG") and k[2:].isalpha() and k.isupper()
    }


def server_env(environ: Mapping[str, str] | None = None) -> dict:
    """What ``mlflow server`` needs from the launcher's environment (the launcher adds its own settings).

    libpq's settings but ``PGPASSWORD`` pass (the launcher moves passwords into the
    server's private ``.pgpass``); MLflow's server settings pass, a client's account does not.
    """
    env = allowed(
        (*BASICS, *PYTHON, *NETWORK, *ARTIFACT_STORES, "MLFLOW_", "GUNICORN_CMD_ARGS", "UVICORN_"),
        (
            *TRACKING_CLIENT,
            "MLFLOW_AUTH_ADMIN_PASSWORD",
            "MLFLOW_BACKEND_STORE_URI",
            "MLFLOW_AUTH_CONFIG_PATH",
        ),
        environ,
    )
    return env | {k: v for k, v in _libpq(environ).items() if k not in ("PGPASSWORD", "PGPASSFILE")}


def watchdog_env(environ: Mapping[str, str] | None = None) -> dict:
    """The server's watchdog is a standard-library script: the basics are all it needs."""
    return allowed(BASICS, (), environ)
