#!/usr/bin/env bash
# Train on any remote GPU machine (a cluster node, a cloud VM) and log to the shared MLflow
# tracking server: the same flow as notebooks/colab_t4.ipynb, as a plain script.
#
# Usage (from a checkout of the project, on the GPU machine):
#   export MLFLOW_TRACKING_URI=https://mlflow.example.org     # the server, behind TLS
#   export MLFLOW_TRACKING_USERNAME=worker1                   # `workbench server add-user worker1`
#   export MLFLOW_TRACKING_PASSWORD=...                       # e.g. from your secret store, never in a file in git
#   export WORKBENCH_STORAGE=postgresql://worker1@db-host/optuna   # the queue `ablate --storage` filled; its password
#                                                             # in ~/.pgpass or PGPASSWORD (never on a command line)
#   scripts/remote_gpu.sh worker                              # drain that queue of protocol cells
#   scripts/remote_gpu.sh ablate --protocol studies/protocols/smoke.yaml    # or run a protocol here
#   scripts/remote_gpu.sh transfer --protocol studies/protocols/retina_transfer.yaml
#
# Whatever the server's state, training runs: while it is unreachable runs go to the local
# store in $WORKBENCH_OFFLINE_DIR (default ./mlflow-offline), and the `workbench sync` at
# the end (or any later one) copies them over, exactly once.
#
# WORKBENCH_DEVICE (default cuda) picks the device: `cpu` runs the same flow on a machine
# without a GPU (the project's tests run this script that way against a local server).
# VENV (default .venv, relative to the checkout or absolute) is where the project is installed.
# Secrets travel in the environment only: `ps` shows every process's command line to every
# user of the machine, so no URL with a password is passed as an argument here.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MLFLOW_TRACKING_URI:?set MLFLOW_TRACKING_URI to the tracking server (https://...)}"
if [[ "$MLFLOW_TRACKING_URI" == http://* && "$MLFLOW_TRACKING_URI" != http://127.0.0.1* && "$MLFLOW_TRACKING_URI" != http://localhost* ]]; then
  echo "WARNING: $MLFLOW_TRACKING_URI is plain HTTP: the password travels unencrypted; put TLS in front of the server" >&2
fi
export WORKBENCH_OFFLINE_DIR="${WORKBENCH_OFFLINE_DIR:-$PWD/mlflow-offline}"
VENV="${VENV:-.venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
DEVICE="${WORKBENCH_DEVICE:-cuda}"

# 1. Install the project (once) into a venv; the machine's CUDA build of torch is kept when present.
if [ ! -x "$VENV/bin/workbench" ]; then
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q -e .
fi
export PATH="$VENV/bin:$PATH"

# 2. The GPU (or the device asked for).
if [ "$DEVICE" = cuda ]; then
  python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible (check CUDA_VISIBLE_DEVICES and the driver)"
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16 {torch.cuda.is_bf16_supported()}")
PY
else
  echo "device: $DEVICE (WORKBENCH_DEVICE)"
fi

# 3. The server: reachable and the credentials accepted? (Unreachable is not fatal: runs go offline.)
workbench server check || echo "continuing: runs will be logged to $WORKBENCH_OFFLINE_DIR until the server is back" >&2

# 4. The work. Data stays on the GPU (the loader holds the whole uint8 tensor on the device);
#    AMP comes from the protocol's run.amp (fp16 on a T4, bf16 on A100/H100).
command="${1:-worker}"
shift || true
if [ "$command" = worker ] && [ -z "${WORKBENCH_STORAGE:-}" ] && [[ " $* " != *" --storage"* ]]; then
  echo "set WORKBENCH_STORAGE to the queue's URL (the Optuna storage \`ablate --storage\` filled)" >&2
  exit 2
fi
extra=()
[ "$command" = worker ] || extra=(--download)  # a worker takes its settings from the queue
status=0
workbench "$command" --device "$DEVICE" ${extra[@]+"${extra[@]}"} "$@" || status=$?

# 5. Copy whatever was logged offline; safe to repeat.
workbench sync || echo "sync failed (server away?): run \`workbench sync\` again later" >&2
exit "$status"
