"""The only package that talks to MLflow (see docs/architecture.md, "Four layers").

Set once, for every process that imports any of it (every command that creates runs):
MLflow's client prints ``View run <name> at: <tracking URI>/#/...`` whenever it ends a run
on a server, the URI's user name and password included when they are in it
(``http://alice:PW@host``), and to a page that opens on the GenAI views. The workbench
prints its own credential-free addresses instead (``tracking.store.ui_links``). Forced, not a
default: a credential on the console is never what a user asked for.

MLflow's per-download progress bar is off by default (a user may set
``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=true``): the workbench reads many small artifacts
(execution records, predictions, configs), and a bar for each one buried the console lines
of a rerun between "Downloading artifacts: 100%" lines.
"""

import os

os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
