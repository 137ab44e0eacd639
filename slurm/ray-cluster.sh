# Ray bring-up and teardown for launched megarl jobs: inlined into every job script `megarl submit`
# renders from slurm/megarl.sbatch, and sourced by launch/local.sh. Everything is stopped by the PID
# this script started it under, never by name (`ray stop` and `pkill ray` hit other jobs' Ray).
#
# Reads: MEGARL_PYTHON, MEGARL_CONTAINER_EXEC (a command prefix such as `apptainer exec ... IMAGE`, or
# empty), MEGARL_DEVICE (cuda|cpu), MEGARL_GPUS_PER_NODE, MEGARL_LOG_DIR, MEGARL_ATTEMPT (names this
# start's log files), MEGARL_RAY_TMPDIR (node-local, one per job), MEGARL_TERM_GRACE_S,
# MEGARL_TEARDOWN_S, the port block exported by `python -m megarl.cluster.ray_ports`, and
# MEGARL_HEAD_IP (head) or MEGARL_RAY_ADDRESS (workers).
#
# Signals. Only the driver may act on a SIGTERM: it writes a checkpoint, then stops what it started.
# Slurm, when it preempts or cancels a job with a grace time, signals every process of every job step
# at once, so each Ray node runs shielded (`python -m megarl.processes shield`: its own session, SIGTERM
# and SIGUSR2 blocked; megarl's Ray actors ignore SIGTERM, `megarl.processes.shield_ray_actor`). The shell that
# started the node still gets the SIGTERM and tells the batch script (SIGUSR1), which forwards it to
# the driver. The batch script stops a node with SIGUSR2; the node then SIGKILLs every process it
# started: the Ray node's session, everything below it (it is a child subreaper) and whatever carries
# its mark (MEGARL_PROCESS_MARK).

megarl_log() {
    echo "megarl-launch $(date '+%F %T'): $*"
}

# The interpreter, inside the job's container when there is one (pyxis containers wrap srun instead).
megarl_python() {
    # shellcheck disable=SC2086  # MEGARL_CONTAINER_EXEC is a command prefix: word splitting wanted
    ${MEGARL_CONTAINER_EXEC:-} "$MEGARL_PYTHON" "$@"
}

# Run Ray on this node until the batch script stops it (SIGUSR2), then keep its logs in
# MEGARL_LOG_DIR/ray-<node>-<attempt>/ and remove the node's Ray temp dir. ROLE is head or worker.
# A `ray start` that fails within its first MEGARL_RAY_START_WINDOW_S seconds (a port raced away, a
# slow file system, a daemon that came up too late) is tried again, up to three times. One srun task
# per node runs this on Slurm.
megarl_ray_node() {
    local role=$1 node=${SLURMD_NODENAME:-$(hostname -s)} pid rc=0 try started ip
    local cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
    local mark="ray-${MEGARL_ATTEMPT:-local}-$node"
    # One temp dir per node under the job's, should two nodes share a /tmp (short: Ray's socket paths are).
    local tmpdir
    tmpdir=$MEGARL_RAY_TMPDIR/$(printf %s "$node" | cksum | cut -d' ' -f1)
    MEGARL_RAY_STOPPING=
    # On CPU a device is a process slot: Ray must offer at least one CPU per slot.
    if [ "$MEGARL_DEVICE" = cpu ] && [ "$cpus" -lt "$MEGARL_GPUS_PER_NODE" ]; then
        cpus=$MEGARL_GPUS_PER_NODE
    fi
    # This node's own address (the interface cluster.env names, else Ray's pick), resolved here, on it.
    ip=${MEGARL_HEAD_IP:-}
    if [ "$role" != head ]; then
        ip=$(megarl_python -m megarl.submit.preflight node-ip) || return 1
    fi
    local args=(start --block --disable-usage-stats --temp-dir="$tmpdir" --num-cpus="$cpus"
        --node-ip-address="$ip"
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
        args+=(--head --port="$MEGARL_RAY_GCS_PORT" --ray-client-server-port="$MEGARL_RAY_CLIENT_SERVER_PORT"
            --include-dashboard=false)
    else
        args+=(--address="$MEGARL_RAY_ADDRESS")
    fi
    trap megarl_node_signalled TERM
    trap 'MEGARL_RAY_STOPPING=1' USR2
    for try in 1 2 3; do
        megarl_log "ray $role on $node ($ip), try $try: ray ${args[*]}"
        # shellcheck disable=SC2086
        MEGARL_PROCESS_MARK=$mark ${MEGARL_CONTAINER_EXEC:-} "$MEGARL_PYTHON" -m megarl.processes shield \
            "$MEGARL_PYTHON" -m ray.scripts.scripts "${args[@]}" &
        pid=$!
        started=$SECONDS
        while kill -0 "$pid" 2>/dev/null && [ -z "$MEGARL_RAY_STOPPING" ]; do
            megarl_nap 0.5
        done
        if [ -n "$MEGARL_RAY_STOPPING" ]; then
            rc=0
            break
        fi
        wait "$pid"
        rc=$?
        megarl_python -m megarl.processes sweep "$mark" "$pid"
        if [ "$rc" -eq 0 ] || [ $((SECONDS - started)) -ge "${MEGARL_RAY_START_WINDOW_S:-300}" ] || [ "$try" -eq 3 ]; then
            break
        fi
        megarl_log "ray $role on $node exited with status $rc during start-up: trying again"
        sleep 2
    done
    trap '' TERM USR2  # nothing interrupts the clean-up below
    # Everything this node started (Ray's daemons and workers, their children, the rollout servers) is
    # found (session, descendants, mark) and SIGKILLed: the driver, which needed them, has exited.
    # (Inside the braces bash's "Killed" notice for the node's own process goes to /dev/null too.)
    { megarl_python -m megarl.processes sweep "$mark" "$pid"; wait "$pid"; } 2>/dev/null
    if [ -d "$tmpdir/session_latest/logs" ]; then
        mkdir -p "$MEGARL_LOG_DIR/ray-$node-$MEGARL_ATTEMPT"
        cp -r "$tmpdir/session_latest/logs/." "$MEGARL_LOG_DIR/ray-$node-$MEGARL_ATTEMPT/"
    fi
    rm -rf "$tmpdir"
    rmdir "$MEGARL_RAY_TMPDIR" 2>/dev/null  # the last node out on a shared /tmp removes the job's dir
    megarl_log "ray $role on $node stopped (status $rc)"
    return "$rc"
}

# A Ray node's step got SIGTERM (Slurm preempts or cancels the job): Ray keeps running; the batch
# script hears of it (SIGUSR1) and forwards a SIGTERM to the driver, which checkpoints.
megarl_node_signalled() {
    if [ -n "${MEGARL_SLURM_JOB:-}" ]; then
        megarl_log "ray node on ${SLURMD_NODENAME:-$(hostname -s)}: SIGTERM from Slurm; telling the batch script"
        scancel --batch --signal=USR1 "$SLURM_JOB_ID"
    fi
}

# Wait for background PID and return its status, handling trapped signals at once (a plain
# `wait` on a long command delays the SIGTERM trap until the command ends). Once a SIGTERM has been
# forwarded (MEGARL_TERM_AT set), PID gets SIGKILL after MEGARL_TERM_GRACE_S seconds. While waiting,
# a Ray node step among MEGARL_WATCH_PIDS that exits fails the wait (status 1) at once.
megarl_wait() {
    local pid=$1 watched
    while kill -0 "$pid" 2>/dev/null; do
        megarl_handle_signals
        if [ -n "${MEGARL_TERM_AT:-}" ] && [ $((SECONDS - MEGARL_TERM_AT)) -ge "$MEGARL_TERM_GRACE_S" ]; then
            megarl_log "pid $pid still running ${MEGARL_TERM_GRACE_S}s after SIGTERM: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        for watched in ${MEGARL_WATCH_PIDS:-}; do
            if ! kill -0 "$watched" 2>/dev/null; then
                megarl_log "a Ray node step (pid $watched) exited; see $MEGARL_LOG_DIR/ray-*-$MEGARL_ATTEMPT.log"
                kill -TERM "$pid" 2>/dev/null
                wait "$pid" 2>/dev/null
                return 1
            fi
        done
        megarl_nap 0.2
    done
    wait "$pid"
}

# Sleep SECONDS, interruptibly: a trapped signal ends the wait at once (a plain `sleep` would hold its
# trap until the sleep ends). The sleep itself is stopped then too, so nothing of this script outlives it.
megarl_nap() {
    local sleeper
    sleep "$1" &
    sleeper=$!
    wait "$sleeper"
    kill "$sleeper" 2>/dev/null
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

# Stop the Ray node(s) started in the background as PID (NAME: their Slurm step name): SIGUSR2 to
# the node's shell. Here PID is that shell; megarl.sbatch redefines this to reach every node of the step.
megarl_stop_ray() {
    megarl_stop_pid "$1" "$MEGARL_TEARDOWN_S" "$3" kill -USR2 "$1"
}

# Forward one stop request to the driver, once: the driver checkpoints and exits; a second SIGTERM
# would make it stop at once, without one. Before the driver runs there is nothing to save; once it has
# exited, its status stands.
megarl_forward_stop() {
    local why=$1
    if [ -n "${MEGARL_TERM_AT:-}" ]; then
        megarl_log "$why: the driver was already told to stop $((SECONDS - MEGARL_TERM_AT))s ago"
    elif [ -n "${MEGARL_DRIVER_DONE:-}" ]; then
        megarl_log "$why: the driver has exited already"
    elif [ -n "${MEGARL_DRIVER_PID:-}" ]; then
        MEGARL_TERM_AT=$SECONDS  # first: a second request may interrupt this handler at its next command
        megarl_signal_driver
        megarl_log "$why: forwarded to the driver (pid $MEGARL_DRIVER_PID) to checkpoint and exit;" \
            "SIGKILL in ${MEGARL_TERM_GRACE_S}s"
    else
        megarl_log "$why before the driver started: tearing down"
        exit 143
    fi
}

# SIGTERM to the driver. megarl.sbatch redefines this where the driver runs as a job step (pyxis).
megarl_signal_driver() {
    kill -TERM "$MEGARL_DRIVER_PID" 2>/dev/null
}

# Trap handlers only note the signal; megarl_wait's loop acts on it between commands. A handler that
# logs parses a command substitution, and bash 5.2 loses its place in one it is parsing when another
# signal's handler runs meanwhile ("unexpected EOF while looking for matching `)'"): a preemption
# brings several signals at once (every node's notice, Slurm's own SIGTERM).
# SIGTERM (Slurm's time-limit warning, `megarl submit --cancel`, a shell's job control) or SIGINT.
megarl_on_term() {
    MEGARL_STOP_REQUESTED=1
    MEGARL_PENDING_TERM=1
}

# Act on the signals the handlers noted.
megarl_handle_signals() {
    if [ -n "${MEGARL_PENDING_TERM:-}" ]; then
        MEGARL_PENDING_TERM=
        megarl_forward_stop SIGTERM
    fi
    megarl_handle_other_signals
}

# The signals only megarl.sbatch traps (the nodes' notice); it redefines this.
megarl_handle_other_signals() {
    return 0
}

# EXIT trap: stop the driver, any bring-up step, the workers, then the head; keep the exit status.
megarl_teardown() {
    local rc=$?
    trap '' TERM INT USR1
    if [ -n "${MEGARL_DRIVER_PID:-}" ]; then megarl_stop_pid "$MEGARL_DRIVER_PID" 30 "the driver"; fi
    if [ -n "${MEGARL_STEP_PID:-}" ]; then megarl_stop_pid "$MEGARL_STEP_PID" 10 "a bring-up step"; fi
    if [ -n "${MEGARL_WORKERS_PID:-}" ]; then
        megarl_stop_ray "$MEGARL_WORKERS_PID" megarl-ray-workers "the Ray workers"
    fi
    if [ -n "${MEGARL_HEAD_PID:-}" ]; then megarl_stop_ray "$MEGARL_HEAD_PID" megarl-ray-head "the Ray head"; fi
    megarl_after_teardown "$rc"
    megarl_log "torn down; exit status $rc"
    exit "$rc"
}

# Called with the exit status once everything is stopped; megarl.sbatch redefines it (requeue).
megarl_after_teardown() {
    return 0
}
