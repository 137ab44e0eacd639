# Ray bring-up and teardown for launched megarl jobs: inlined into every job script `megarl submit`
# renders from slurm/megarl.sbatch, and sourced by launch/local.sh. Everything is stopped by the PID
# this script started it under, never by name (`ray stop` and `pkill ray` hit other jobs' Ray).
#
# Reads: MEGARL_PYTHON, MEGARL_DEVICE (cuda|cpu), MEGARL_GPUS_PER_NODE, MEGARL_LOG_DIR,
# MEGARL_RAY_TMPDIR (node-local, one per job), MEGARL_TERM_GRACE_S, the port block exported by
# `python -m megarl.submit.ray_ports`, and MEGARL_HEAD_IP (head) or MEGARL_RAY_ADDRESS (workers).

megarl_log() {
    echo "megarl-launch $(date '+%F %T'): $*"
}

# Run Ray on this node until SIGTERM, then keep its logs in MEGARL_LOG_DIR/ray-<node>/ and remove
# the node's Ray temp dir. ROLE is head or worker. One srun task per node runs this on Slurm.
megarl_ray_node() {
    local role=$1 node=${SLURMD_NODENAME:-$(hostname -s)} pid rc
    local cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
    # On CPU a device is a process slot: Ray must offer at least one CPU per slot.
    if [ "$MEGARL_DEVICE" = cpu ] && [ "$cpus" -lt "$MEGARL_GPUS_PER_NODE" ]; then
        cpus=$MEGARL_GPUS_PER_NODE
    fi
    local args=(start --block --disable-usage-stats --temp-dir="$MEGARL_RAY_TMPDIR" --num-cpus="$cpus"
        --node-manager-port="$MEGARL_RAY_NODE_MANAGER_PORT"
        --object-manager-port="$MEGARL_RAY_OBJECT_MANAGER_PORT"
        --min-worker-port="$MEGARL_RAY_MIN_WORKER_PORT" --max-worker-port="$MEGARL_RAY_MAX_WORKER_PORT"
        --dashboard-agent-grpc-port="$MEGARL_RAY_DASHBOARD_AGENT_GRPC_PORT"
        --dashboard-agent-listen-port="$MEGARL_RAY_DASHBOARD_AGENT_LISTEN_PORT"
        --metrics-export-port="$MEGARL_RAY_METRICS_EXPORT_PORT"
        --runtime-env-agent-port="$MEGARL_RAY_RUNTIME_ENV_AGENT_PORT")
    if [ "$MEGARL_DEVICE" = cuda ]; then
        args+=(--num-gpus="$MEGARL_GPUS_PER_NODE")
    fi
    if [ "$role" = head ]; then
        args+=(--head --node-ip-address="$MEGARL_HEAD_IP" --port="$MEGARL_RAY_GCS_PORT"
            --ray-client-server-port="$MEGARL_RAY_CLIENT_SERVER_PORT" --include-dashboard=false)
    else
        args+=(--address="$MEGARL_RAY_ADDRESS")
    fi
    megarl_log "ray $role on $node: ray ${args[*]}"
    "$MEGARL_PYTHON" -m ray.scripts.scripts "${args[@]}" &
    pid=$!
    # Slurm signals every process of the step at once; this trap only keeps the shell alive long
    # enough to wait for Ray and clean up after it.
    trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
    wait "$pid"
    rc=$?
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid"
        rc=$?
    done
    trap - TERM INT
    if [ -d "$MEGARL_RAY_TMPDIR/session_latest/logs" ]; then
        mkdir -p "$MEGARL_LOG_DIR/ray-$node"
        cp -r "$MEGARL_RAY_TMPDIR/session_latest/logs/." "$MEGARL_LOG_DIR/ray-$node/"
    fi
    rm -rf "$MEGARL_RAY_TMPDIR"
    megarl_log "ray $role on $node stopped (status $rc)"
    return "$rc"
}

# Wait for background PID and return its status, handling trapped signals at once (a plain
# `wait` on a long command delays the SIGTERM trap until the command ends). Once a SIGTERM has been
# forwarded (MEGARL_TERM_AT set), PID gets SIGKILL after MEGARL_TERM_GRACE_S seconds.
megarl_wait() {
    local pid=$1
    while kill -0 "$pid" 2>/dev/null; do
        if [ -n "${MEGARL_TERM_AT:-}" ] && [ $((SECONDS - MEGARL_TERM_AT)) -ge "$MEGARL_TERM_GRACE_S" ]; then
            megarl_log "pid $pid still running ${MEGARL_TERM_GRACE_S}s after SIGTERM: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        sleep 0.2 &
        wait $!
    done
    wait "$pid"
}

# Run one bring-up command in the background and wait for it (interruptibly); teardown stops it
# through MEGARL_STEP_PID if a signal arrives meanwhile.
megarl_step() {
    local rc
    "$@" &
    MEGARL_STEP_PID=$!
    megarl_wait "$MEGARL_STEP_PID"
    rc=$?
    MEGARL_STEP_PID=
    return "$rc"
}

# Stop PID, a process this script started: run COMMAND (default: SIGTERM to PID), wait up to GRACE
# seconds, then SIGKILL it. WHAT names it in the log.
megarl_stop_pid() {
    local pid=$1 grace=$2 what=$3
    shift 3
    if kill -0 "$pid" 2>/dev/null; then
        megarl_log "stopping $what (pid $pid)"
        if [ $# -gt 0 ]; then "$@"; else kill -TERM "$pid" 2>/dev/null; fi
        local deadline=$((SECONDS + grace))
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            megarl_log "$what (pid $pid) still running after ${grace}s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    wait "$pid" 2>/dev/null
    return 0
}

# Stop the Ray node(s) started in the background as PID (NAME: their Slurm step name). Here a plain
# SIGTERM to PID; megarl.sbatch redefines it to reach every node of the step.
megarl_stop_ray() {
    megarl_stop_pid "$1" 60 "$3"
}

# SIGTERM (Slurm's preemption / time-limit warning) or SIGINT: the driver gets it so the run can
# write a checkpoint and exit; before the driver runs there is nothing to save, so just tear down.
megarl_on_term() {
    if [ -n "${MEGARL_DRIVER_PID:-}" ] && kill -0 "$MEGARL_DRIVER_PID" 2>/dev/null; then
        megarl_log "SIGTERM: forwarded to the driver (pid $MEGARL_DRIVER_PID) to checkpoint and exit;" \
            "SIGKILL in ${MEGARL_TERM_GRACE_S}s"
        MEGARL_TERM_AT=${MEGARL_TERM_AT:-$SECONDS}
        kill -TERM "$MEGARL_DRIVER_PID" 2>/dev/null
    else
        megarl_log "SIGTERM before the driver started: tearing down"
        exit 143
    fi
}

# EXIT trap: stop the driver, any bring-up step, the workers, then the head; keep the exit status.
megarl_teardown() {
    local rc=$?
    trap '' TERM INT
    if [ -n "${MEGARL_DRIVER_PID:-}" ]; then megarl_stop_pid "$MEGARL_DRIVER_PID" 30 "the driver"; fi
    if [ -n "${MEGARL_STEP_PID:-}" ]; then megarl_stop_pid "$MEGARL_STEP_PID" 10 "a bring-up step"; fi
    if [ -n "${MEGARL_WORKERS_PID:-}" ]; then
        megarl_stop_ray "$MEGARL_WORKERS_PID" megarl-ray-workers "the Ray workers"
    fi
    if [ -n "${MEGARL_HEAD_PID:-}" ]; then megarl_stop_ray "$MEGARL_HEAD_PID" megarl-ray-head "the Ray head"; fi
    megarl_log "torn down; exit status $rc"
    exit "$rc"
}
