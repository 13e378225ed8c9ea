#!/usr/bin/env bash
# The real compose test, on a real engine: installs docker.io and docker-compose if missing,
# starts dockerd (its own socket, data-root and log), builds the base image, the wheelhouse and
# the node and Prometheus images, brings up a swarm (bootstrap + N workers + Prometheus) with
# docker-compose, and checks through Prometheus' HTTP API that every node target is up, that
# exchanges succeeded and that every node's validation loss went down; then that the dashboard
# page answers and proxies the series, that every Grafana dashboard query is valid PromQL,
# that the nodes are healthy and that they stop cleanly (exit 0) on SIGTERM. Everything it
# started is torn down in an EXIT trap, also on failure or timeout: the compose project (containers,
# networks, volumes), dockerd and its containerd, the iptables rules and chains and the bridges
# dockerd made, and (unless --keep-data) the engine's data-root.
#
#   sudo scripts/compose_test.sh [--workers N] [--infra-only] [--keep-data] [--timeout-s S]
#
#   --workers N     workers besides the bootstrap node (default 2: 3 nodes)
#   --infra-only    check only the infrastructure: Prometheus answers and scrapes itself, it
#                   discovered every node by DNS, the dashboard page answers, the nodes are
#                   healthy and stop cleanly (no node metrics needed)
#   --keep-data     keep the engine's data-root (images: faster reruns on this machine)
#   --timeout-s S   overall deadline (default 1200 s); each phase gets what is left
# Environment: GASLOC_PROMETHEUS_PORT (19090), GASLOC_DASHBOARD_PORT (18050): host ports;
# GASLOC_COMPOSE_OVERRIDE=FILE: an extra compose file; GASLOC_DOCKER_DATA_ROOT.
#
# If an engine already answers (DOCKER_HOST or /var/run/docker.sock) it is used and left
# running; only this test's compose project is removed. Needs root (dockerd, debootstrap).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKERS=2
INFRA_ONLY=0
KEEP_DATA=0
DEADLINE_S=1200
while [[ $# -gt 0 ]]; do
    case "$1" in
        --workers) WORKERS="$2"; shift 2 ;;
        --infra-only) INFRA_ONLY=1; shift ;;
        --keep-data) KEEP_DATA=1; shift ;;
        --timeout-s) DEADLINE_S="$2"; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "compose_test: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ && "$DEADLINE_S" =~ ^[1-9][0-9]*$ ]] || {
    echo "compose_test: --workers and --timeout-s take positive integers" >&2; exit 2; }
NODES=$((WORKERS + 1))
PROJECT=gasloc_ct
ENGINE_DIR=/run/gasloc-docker          # socket, pidfile, exec-root
DATA_ROOT="${GASLOC_DOCKER_DATA_ROOT:-/var/lib/gasloc-docker}"
WORK="$(mktemp -d /tmp/gasloc-compose-test.XXXXXX)"
PROM_PORT="${GASLOC_PROMETHEUS_PORT:-19090}"
DASH_PORT="${GASLOC_DASHBOARD_PORT:-18050}"
T0=$SECONDS
OWN_ENGINE=0
COMPOSE_UP=0
declare -a TIMINGS=()

log() { printf '[compose_test %4ds] %s\n' $((SECONDS - T0)) "$*"; }
die() { log "FAIL: $*"; exit 1; }
remaining() {  # seconds left of the overall deadline (0 when it has passed)
    local left=$((DEADLINE_S - (SECONDS - T0)))
    echo $((left > 0 ? left : 0))
}
# phase NAME CMD...: run CMD (a program bounded by the time left, or a function of this
# script), with its output in $WORK/NAME.log (shown if it fails); -v shows it as it comes. The
# phase runs as a background job in its own process group: `wait` lets a signal's trap run at
# once, and the teardown ends the whole group (grandchildren too) if the phase is still going.
PHASE_PID=""
phase() {
    local verbose=0
    if [[ "$1" == -v ]]; then verbose=1; shift; fi
    local name="$1"; shift
    local start=$SECONDS rc=0 out="$WORK/$name.log" left
    left="$(remaining)"
    (( left > 0 )) || die "overall deadline of ${DEADLINE_S}s reached before phase $name"
    log "phase $name: start"
    # A program gets the time left; a function (a subshell here) bounds its own commands.
    local cmd=("$@")
    declare -F "$1" >/dev/null || cmd=(timeout --foreground --kill-after=20 "$left" "$@")
    set -m
    if (( verbose )); then "${cmd[@]}" & else "${cmd[@]}" >"$out" 2>&1 & fi
    PHASE_PID=$!
    set +m
    wait "$PHASE_PID" || rc=$?
    PHASE_PID=""
    TIMINGS+=("$(printf '%-12s %5d s' "$name" $((SECONDS - start)))")
    if (( rc != 0 )); then
        (( verbose )) || tail -n 40 "$out" | sed 's/^/    /'
        die "phase $name failed (exit $rc$( ((rc == 124)) && echo ', timed out'))"
    fi
    log "phase $name: done in $((SECONDS - start)) s"
}

# ---------------------------------------------------------------- teardown (EXIT trap)
iptables_cleanup() {  # rules jumping to DOCKER* chains or naming dockerd's bridges, then chains
    local table rule
    command -v iptables-save >/dev/null || return 0
    for table in filter nat; do
        iptables-save -t "$table" 2>/dev/null \
            | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) ' \
            | grep -E -- '-j DOCKER|(-i|-o) (docker0|br-[0-9a-f]{12})' \
            | while read -r rule; do
                # shellcheck disable=SC2086  # the rule is iptables-save's word list
                eval "iptables -t $table -D ${rule#-A }" 2>/dev/null || true
            done
        iptables-save -t "$table" 2>/dev/null | sed -n 's/^:\(DOCKER[A-Z0-9_-]*\) .*/\1/p' \
            | while read -r chain; do iptables -t "$table" -F "$chain" 2>/dev/null || true; done
        iptables-save -t "$table" 2>/dev/null | sed -n 's/^:\(DOCKER[A-Z0-9_-]*\) .*/\1/p' \
            | while read -r chain; do iptables -t "$table" -X "$chain" 2>/dev/null || true; done
    done
    if [[ -n "${FORWARD_POLICY:-}" ]]; then iptables -P FORWARD "$FORWARD_POLICY" || true; fi
    # With iptables-nft, dockerd's first rule creates the `ip filter` / `ip nat` tables: drop
    # them again if they were not there before and hold nothing but empty built-in chains.
    command -v nft >/dev/null || return 0
    for table in filter nat; do
        grep -qx "table ip $table" "$WORK/nft.before" 2>/dev/null && continue
        nft list table ip "$table" >/dev/null 2>&1 || continue
        if ! iptables-save -t "$table" | grep -qE '^-A '; then
            nft delete table ip "$table" || true
        fi
    done
}

stop_engine() {
    local pid
    pid="$(cat "$ENGINE_DIR/dockerd.pid" 2>/dev/null || true)"
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && { log "dockerd did not stop: SIGKILL"; kill -KILL "$pid"; }
    fi
    # dockerd's own containerd and its shims name our exec-root: kill any it left, by pid.
    local leftover
    mapfile -t leftover < <(pgrep -f -- "$ENGINE_DIR/exec/" || true)
    if (( ${#leftover[@]} )); then
        log "killing leftover engine processes: ${leftover[*]}"
        kill -KILL "${leftover[@]}" || true
    fi
    # Mounts an unclean stop may leave (overlays, netns, shm), then our directories.
    findmnt -rn -o TARGET | grep -E "^($ENGINE_DIR|$DATA_ROOT)(/|$)" | sort -r \
        | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    # Bridges dockerd made (docker0, br-<network id>), not ones that were there before us.
    # veths are not touched: they go with the containers' namespaces, and other tests on this
    # machine may own some.
    local link
    for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
        if [[ "$link" == docker0 || "$link" =~ ^br-[0-9a-f]{12}$ ]] \
            && ! grep -qx "$link" "$WORK/links.before"; then
            ip link delete "$link" 2>/dev/null || true
        fi
    done
    iptables_cleanup
    if [[ -n "${IP_FORWARD:-}" ]]; then sysctl -q -w "net.ipv4.ip_forward=$IP_FORWARD" || true; fi
    rm -rf "$ENGINE_DIR"
    if (( KEEP_DATA == 0 )); then rm -rf --one-file-system "$DATA_ROOT"; fi
}

teardown() {
    local rc=$? start=$SECONDS
    trap - EXIT INT TERM
    set +e
    log "teardown (exit status $rc)"
    if [[ -n "$PHASE_PID" ]]; then  # a phase still runs: end its process group, its own way
        kill -TERM -- "-$PHASE_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 -- "-$PHASE_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$PHASE_PID" 2>/dev/null
    fi
    if (( COMPOSE_UP )); then
        if (( rc != 0 )); then
            log "last logs of the swarm:"
            timeout 60 "${COMPOSE[@]}" logs --no-color --tail=25 2>&1 | sed 's/^/    /'
        fi
        timeout 120 "${COMPOSE[@]}" down -v --remove-orphans -t 20 >/dev/null 2>&1 \
            || log "compose down failed"
    fi
    if (( OWN_ENGINE )); then
        stop_engine
        local left
        left="$(ip -o link show | grep -cE ': (docker0|br-[0-9a-f]{12})[:@]')"
        (( left == 0 )) || log "WARNING: $left docker bridge(s) left"
        if command -v iptables-save >/dev/null && iptables-save | grep -q DOCKER; then
            log "WARNING: iptables still mentions DOCKER"
        fi
    fi
    rm -rf "$WORK"
    TIMINGS+=("$(printf '%-12s %5d s' teardown $((SECONDS - start)))")
    log "timings:"
    local t
    for t in "${TIMINGS[@]}"; do echo "    $t"; done
    echo "    total        $((SECONDS - T0)) s"
    if (( rc == 0 )); then log "PASS"; else log "FAIL (exit $rc)"; fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- phases
[[ $(id -u) -eq 0 ]] || die "run as root (dockerd, debootstrap, iptables)"
ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 > "$WORK/links.before"

install_tools() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v iptables >/dev/null || missing+=(iptables)
    (( ${#missing[@]} )) || return 0
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get install -y -q "${missing[@]}" >"$WORK/apt.log" 2>&1 \
        || { timeout 300 apt-get update -q >>"$WORK/apt.log" 2>&1 \
             && timeout 600 apt-get install -y -q "${missing[@]}" >>"$WORK/apt.log" 2>&1; } \
        || { tail -20 "$WORK/apt.log"; return 1; }
}
phase install install_tools
DOCKER="${DOCKER:-/usr/bin/docker}"  # docker.io's CLI, matching its daemon
[[ -x "$DOCKER" ]] || DOCKER="$(command -v docker)"
export DOCKER

start_engine() {
    if [[ -z "${DOCKER_HOST:-}" ]] && "$DOCKER" info >/dev/null 2>&1; then
        log "an engine already runs on the default socket: using it, leaving it running"
        return 0
    fi
    if [[ -n "${DOCKER_HOST:-}" ]]; then
        "$DOCKER" info >/dev/null 2>&1 \
            || { log "DOCKER_HOST=$DOCKER_HOST does not answer"; return 1; }
        log "using the engine at DOCKER_HOST=$DOCKER_HOST, leaving it running"; return 0
    fi
    local old
    old="$(cat "$ENGINE_DIR/dockerd.pid" 2>/dev/null || true)"
    if [[ -n "$old" ]] && kill -0 "$old" 2>/dev/null; then
        log "a dockerd of an earlier run is still up; stop it first (pid $old)"
        return 1
    fi
    # dockerd turns on forwarding and sets the FORWARD policy to DROP: both are put back.
    FORWARD_POLICY="$(iptables -S FORWARD 2>/dev/null | sed -n 's/^-P FORWARD //p')"
    IP_FORWARD="$(sysctl -n net.ipv4.ip_forward)"
    if command -v nft >/dev/null; then nft list tables >"$WORK/nft.before" 2>/dev/null || true; fi
    mkdir -p "$ENGINE_DIR" "$DATA_ROOT"
    OWN_ENGINE=1
    # setsid: its own session, so signals meant for this script never reach dockerd.
    setsid dockerd --data-root "$DATA_ROOT" --exec-root "$ENGINE_DIR/exec" \
        --pidfile "$ENGINE_DIR/dockerd.pid" -H "unix://$ENGINE_DIR/docker.sock" \
        --log-level warn >"$WORK/dockerd.log" 2>&1 </dev/null &
    export DOCKER_HOST="unix://$ENGINE_DIR/docker.sock"
    for _ in $(seq 120); do
        "$DOCKER" info >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    tail -20 "$WORK/dockerd.log"
    return 1
}
# Not through `phase`: it sets variables of this shell (OWN_ENGINE, DOCKER_HOST).
log "phase engine: start"; s=$SECONDS
start_engine || die "dockerd did not start (log: $WORK/dockerd.log)"
TIMINGS+=("$(printf '%-12s %5d s' engine $((SECONDS - s)))")
log "phase engine: done in $((SECONDS - s)) s ($("$DOCKER" version -f '{{.Server.Version}}'))"

phase base-image "$ROOT/docker/build_base.sh" gasloc-base:bookworm
phase wheels "$ROOT/docker/fetch_wheels.sh"
phase node-image "$DOCKER" build -f "$ROOT/docker/Dockerfile" -t gasloc-node:latest "$ROOT"
phase prom-image "$DOCKER" build -f "$ROOT/docker/prometheus.Dockerfile" \
    -t gasloc-prometheus:latest "$ROOT/docker"

# Faster validation than the default (every 100 steps) so that the loss can be seen to fall.
export GASLOC_RUN_ID=compose-test GASLOC_EVAL_INTERVAL_STEPS=30 \
    GASLOC_PROMETHEUS_PORT="$PROM_PORT" GASLOC_DASHBOARD_PORT="$DASH_PORT"
COMPOSE=(docker-compose --project-directory "$ROOT" -f "$ROOT/docker-compose.yml" -p "$PROJECT")
# GASLOC_COMPOSE_OVERRIDE=FILE: one more compose file on top (to try a variant of the swarm).
if [[ -n "${GASLOC_COMPOSE_OVERRIDE:-}" ]]; then COMPOSE+=(-f "$GASLOC_COMPOSE_OVERRIDE"); fi
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true  # an earlier run's leftovers
COMPOSE_UP=1
phase compose-up "${COMPOSE[@]}" up -d --no-build --scale "worker=$WORKERS"

# ---------------------------------------------------------------- checks through Prometheus
check() {
    local budget
    budget="$(remaining)"; (( budget < 900 )) || budget=900
    python3 - "$PROM_PORT" "$NODES" "$INFRA_ONLY" "$budget" \
        "$ROOT/docker/grafana/dashboards/gasloc.json" "$DASH_PORT" <<'EOF'
"""Poll Prometheus every 10 s until the swarm passes (exit 0) or the budget is spent (1)."""
import json
import math
import sys
import time
import urllib.parse
import urllib.request

port, nodes, infra_only = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
deadline = time.monotonic() + float(sys.argv[4])
base = f"http://127.0.0.1:{port}/api/v1"


def get(path, **params):
    url = f"{base}/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def query(expr):
    return get("query", query=expr)["result"]


def scalar(expr):
    result = query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def finite(values):
    return [float(v) for _, v in values if math.isfinite(float(v))]


last = ""
while True:
    try:
        self_up = scalar('up{job="prometheus"}')
        targets = [t for t in get("targets", state="active")["activeTargets"]
                   if t["labels"].get("job") == "gasloc"]
        lines = [f"prometheus up={self_up:.0f}, node targets discovered {len(targets)}/{nodes}"]
        ok = self_up == 1 and len(targets) == nodes
        if not infra_only:
            up = scalar('sum(up{job="gasloc"})')
            exchanges = scalar('sum(gasloc_exchanges_total{job="gasloc", outcome="ok"})')
            lines.append(f"nodes up {up:.0f}/{nodes}, exchanges ok {exchanges:.0f}")
            series = query('gasloc_val_loss{job="gasloc"}[30m]')
            falling = 0
            for s in sorted(series, key=lambda s: s["metric"]["instance"]):
                vals = finite(s["values"])
                steps = scalar(f'gasloc_train_steps_total{{instance="{s["metric"]["instance"]}"}}')
                first, latest = (vals[0], vals[-1]) if vals else (math.nan, math.nan)
                down = len(vals) >= 2 and latest < first
                falling += down
                lines.append(f"  {s['metric'].get('role', '?'):9} {s['metric']['instance']:21} "
                             f"step {steps:6.0f}  val loss {first:.4f} -> {latest:.4f}"
                             f"{'  (down)' if down else ''}")
            ok = ok and up == nodes and exchanges > 0 and falling == nodes == len(series)
        report = "\n".join(lines)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        ok, report = False, f"prometheus not answering yet: {exc}"
    if report != last:
        print(report, flush=True)
        last = report
    if ok:
        break
    if time.monotonic() > deadline:
        print(f"not passed within {sys.argv[4]} s", flush=True)
        sys.exit(1)
    time.sleep(10)

# The project's dashboard page (service `dashboard`): it answers, and its proxy to Prometheus
# returns the swarm's series.
page = f"http://127.0.0.1:{sys.argv[6]}"
while True:
    try:
        with urllib.request.urlopen(f"{page}/healthz", timeout=10) as resp:
            healthy = resp.status == 200
        if not infra_only:
            with urllib.request.urlopen(f"{page}/", timeout=10) as resp:
                html = resp.read().decode()
            with urllib.request.urlopen(f"{page}/api/v1/query?query=gasloc_tokens_per_second",
                                        timeout=10) as resp:
                proxied = json.load(resp)["data"]["result"]
            healthy = healthy and "<html" in html.lower() and len(proxied) == nodes
        if healthy:
            print(f"dashboard page {page}: up" + ("" if infra_only else
                  f", {len(html)} bytes, proxy returns {len(proxied)} node series"), flush=True)
            break
    except (OSError, ValueError, KeyError) as exc:
        healthy = False
        print(f"dashboard page {page}: not answering yet ({exc})", flush=True)
    if time.monotonic() > deadline:
        print(f"dashboard page {page} not ready in time", flush=True)
        sys.exit(1)
    time.sleep(5)

if infra_only:
    sys.exit(0)
# The Grafana dashboard cannot be rendered here, but its queries can run: each must be valid
# PromQL for this Prometheus (an error fails the test); most should already return data.
panels = json.load(open(sys.argv[5]))["panels"]
exprs = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
empty = []
for title, expr in exprs:
    try:
        if not query(expr.replace("$instance", ".*")):
            empty.append(title)
    except (OSError, RuntimeError) as exc:
        print(f"dashboard panel {title!r}: query failed: {exc}\n  {expr}", flush=True)
        sys.exit(1)
print(f"dashboard: {len(exprs)} queries valid, {len(exprs) - len(empty)} return data"
      + (f" (no data yet: {', '.join(sorted(set(empty)))})" if empty else ""), flush=True)
EOF
}
phase -v check check

nodes_healthy() {  # every node container turns healthy (the image's HEALTHCHECK), in 300 s
    local id healthy line
    for _ in $(seq 60); do
        healthy=0 line=""
        for id in $(timeout 60 "${COMPOSE[@]}" ps -q bootstrap worker); do
            line+="$("$DOCKER" inspect -f '{{.Name}}={{.State.Health.Status}}' "$id") "
            [[ "$line" == *=healthy" " ]] && healthy=$((healthy + 1))
        done
        if (( healthy == NODES )); then log "  $line"; return 0; fi
        sleep 5
    done
    log "  not all healthy: $line"
    return 1
}
phase -v health nodes_healthy

# A clean stop: SIGTERM through tini reaches every node, which exits 0 well within the grace.
clean_stop() {
    local id code bad=0
    timeout 120 "${COMPOSE[@]}" stop -t 30 bootstrap worker >/dev/null 2>&1
    for id in $(timeout 60 "${COMPOSE[@]}" ps -q bootstrap worker); do
        code="$("$DOCKER" inspect -f '{{.Name}} exit {{.State.ExitCode}}' "$id")"
        log "  $code"
        [[ "$code" == *" exit 0" ]] || bad=1
    done
    (( bad == 0 ))
}
phase -v clean-stop clean_stop
