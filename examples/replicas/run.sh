#!/usr/bin/env bash
# Three pilotfish replicas and one etcd on this machine, for trying failover by hand.
#
#   examples/replicas/run.sh            # from the repository root, after `make setup`
#
# It starts etcd (its own data dir under $WORK), then three `pilotfish serve` on the ports below,
# waits until each answers /healthz on its admin API, prints an Envoy bootstrap listing all three,
# and waits. Ctrl-C (or SIGTERM to this script) stops every process it started, by PID, and
# removes $WORK unless you gave it. Try:
#
#   examples/replicas/run.sh > envoy.yaml &        # the bootstrap goes to stdout, the rest to stderr
#   .venv/bin/envoy -c envoy.yaml --use-dynamic-base-id &
#   curl -s 127.0.0.1:18001/v1/proxies             # which replica holds Envoy's stream? kill it:
#   kill -9 <its pid, printed at start-up>         # Envoy moves to another within about a second
#
# Settings (environment variables): PILOTFISH (the command, default .venv/bin/pilotfish), ETCD
# (default etcd), WORK (a directory for etcd's data and the logs; default a fresh temp dir),
# BASE_PORT (default 18000: replica i serves xDS on BASE_PORT+10i, its admin API on +1, its
# registry API on +2; etcd listens on BASE_PORT+79 for clients, +80 for peers), NODE_ID (the
# Envoy's node id in the printed bootstrap, default edge-1).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
read -r -a pilotfish <<< "${PILOTFISH:-$root/.venv/bin/pilotfish}"
etcd_bin=${ETCD:-etcd}
base=${BASE_PORT:-18000}
node_id=${NODE_ID:-edge-1}
host=127.0.0.1

if [[ -n "${WORK:-}" ]]; then work=$WORK; keep_work=1; mkdir -p "$work"; else work=$(mktemp -d); keep_work=0; fi
command -v "$etcd_bin" >/dev/null || { echo "no $etcd_bin: install the Debian package etcd-server" >&2; exit 1; }
command -v "${pilotfish[0]}" >/dev/null || { echo "no ${pilotfish[0]}: run make setup, or set PILOTFISH" >&2; exit 1; }

pids=()
stop() {
    trap - EXIT INT TERM
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [[ $keep_work == 0 ]]; then rm -rf "$work"; fi
    echo "stopped: ${pids[*]}" >&2
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_for() {  # wait_for URL WHAT PID: poll until URL answers 2xx, or fail if PID died
    for _ in $(seq 1 200); do
        if curl -sf -o /dev/null "$1"; then return 0; fi
        kill -0 "$3" 2>/dev/null || { echo "$2 exited; see $work" >&2; return 1; }
        sleep 0.1
    done
    echo "$2 did not answer $1 within 20 s; see $work" >&2
    return 1
}

etcd_client=$host:$((base + 79))
etcd_peer=$host:$((base + 80))
"$etcd_bin" --name pilotfish-example --data-dir "$work/etcd.data" \
    --listen-client-urls "http://$etcd_client" --advertise-client-urls "http://$etcd_client" \
    --listen-peer-urls "http://$etcd_peer" --initial-advertise-peer-urls "http://$etcd_peer" \
    --initial-cluster "pilotfish-example=http://$etcd_peer" >"$work/etcd.log" 2>&1 &
pids+=($!)
wait_for "http://$etcd_client/health" etcd "$!"
echo "etcd: pid $!, client API $etcd_client, data $work/etcd.data" >&2

xds=()
for i in 0 1 2; do
    port=$((base + 10 * i))
    # --xds: where Envoys connect (every replica is listed in their bootstrap);
    # --etcd: the shared state: every replica builds the same snapshot from it;
    # --registry: the registry HTTP API (any replica takes any write);
    # --admin: /healthz, /readyz and /v1/proxies of this replica (keep it on loopback);
    # --event-log: what this replica sent to whom, as JSON lines.
    "${pilotfish[@]}" serve --etcd "$etcd_client" --xds "$host:$port" --admin "$host:$((port + 1))" \
        --registry "$host:$((port + 2))" --event-log "$work/replica-$i.events.jsonl" \
        >"$work/replica-$i.log" 2>&1 &
    pids+=($!)
    wait_for "http://$host:$((port + 1))/healthz" "replica $i" "$!"
    echo "replica $i: pid $!, xDS $host:$port, admin $host:$((port + 1)), registry $host:$((port + 2))" >&2
    xds+=("$host:$port")
done

(IFS=,; "${pilotfish[@]}" bootstrap --node-id "$node_id" --xds "${xds[*]}" --admin-port $((base + 90)))
echo "ready: the Envoy bootstrap above lists all three replicas; Ctrl-C stops everything" >&2
wait
