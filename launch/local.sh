#!/usr/bin/env bash
# Run a recipe on this machine the way a Slurm job runs it across nodes: a private Ray head (its own
# port block, temp dir and auth token, on loopback), preflight, the registration wait, then
# `megarl train RECIPE --ray-address ...` as the driver. SIGTERM/SIGINT go to the driver so the run
# can checkpoint; on every exit the driver and Ray are stopped by the PIDs this script started.
#
#   launch/local.sh RECIPE [--set KEY=VALUE ...]
#
# MEGARL_PYTHON picks the interpreter (default: python3 on PATH); the recipe's cluster.env is exported.
# Logs: <run dir>/logs/ray-head-<host>-local.log and <run dir>/logs/ray-<host>-local/ (Ray's own logs).
set -uo pipefail
if [ $# -lt 1 ] || [ "${1:0:1}" = - ]; then
    echo "usage: launch/local.sh RECIPE [--set KEY=VALUE ...]" >&2
    exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../slurm/ray-cluster.sh
source "$repo/slurm/ray-cluster.sh"
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
export MEGARL_PYTHON=${MEGARL_PYTHON:-$(command -v python3)}
recipe=$1
shift

job=$("$MEGARL_PYTHON" -m megarl.submit.local "$recipe" "$@") || exit $?
eval "$job"
eval "$("$MEGARL_PYTHON" -m megarl.cluster.ray_ports --seed $$ --free)" || exit 1
host=$(hostname -s)
export MEGARL_LOG_DIR=$MEGARL_RUN_DIR/logs
mkdir -p "$MEGARL_LOG_DIR"
MEGARL_RAY_TMPDIR=$(mktemp -d /tmp/megarl-ray-XXXXXX) || exit 1
export MEGARL_RAY_TMPDIR
export MEGARL_ATTEMPT=local
# One machine: Ray stays on loopback, out of reach of other hosts.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 MEGARL_HEAD_IP=127.0.0.1
export MEGARL_RAY_ADDRESS=$MEGARL_HEAD_IP:$MEGARL_RAY_GCS_PORT
# A SIGTERM to this script's process group (a shell's job control) reaches Ray too: only the driver
# acts on it (see slurm/ray-cluster.sh).
export MEGARL_SHIELD_SIGTERM=1
export RAY_USAGE_STATS_ENABLED=0 RAY_enable_metrics_collection=0 RAY_AUTH_MODE=token
# The token lives in the environment of this job's processes only, never on a command line.
RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n') || exit 1
export RAY_AUTH_TOKEN

trap megarl_on_term TERM INT
trap megarl_teardown EXIT

"$MEGARL_PYTHON" -m megarl.submit.preflight facts --device "$MEGARL_DEVICE" --port-seed $$ \
    >"$MEGARL_LOG_DIR/preflight-local.jsonl" || exit 1
"$MEGARL_PYTHON" -m megarl.submit.preflight check --nodes "$host" --device "$MEGARL_DEVICE" \
    --gpus-per-node "$MEGARL_GPUS_PER_NODE" <"$MEGARL_LOG_DIR/preflight-local.jsonl" || exit 1

megarl_log "ray head at $MEGARL_RAY_ADDRESS (temp dir $MEGARL_RAY_TMPDIR)"
megarl_ray_node head >"$MEGARL_LOG_DIR/ray-head-$host-local.log" 2>&1 &
MEGARL_HEAD_PID=$!
MEGARL_WATCH_PIDS=$MEGARL_HEAD_PID
megarl_step "$MEGARL_PYTHON" -m megarl.submit.registration --address "$MEGARL_RAY_ADDRESS" --nodes 1 \
    --device "$MEGARL_DEVICE" --per-node "$MEGARL_GPUS_PER_NODE" --hosts "$host" --log-dir "$MEGARL_LOG_DIR" \
    --attempt local --timeout 300 || exit 1
MEGARL_WATCH_PIDS=

megarl_log "driver: megarl train $recipe --ray-address $MEGARL_RAY_ADDRESS $*"
"$MEGARL_PYTHON" -m megarl train "$recipe" --ray-address "$MEGARL_RAY_ADDRESS" "$@" &
MEGARL_DRIVER_PID=$!
megarl_wait "$MEGARL_DRIVER_PID"
rc=$?
MEGARL_DRIVER_DONE=1
megarl_log "driver exited with status $rc${MEGARL_TERM_AT:+ after SIGTERM}"
exit "$rc"
