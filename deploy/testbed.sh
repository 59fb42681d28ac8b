#!/usr/bin/env bash
# FusionNode testbed: one Linux network namespace per device of a cluster file, a veth pair per
# device pair with that link's bandwidth enforced by a `tc tbf` qdisc on each side, and a
# `fusionnode join` daemon in every namespace (device 0 is the bootstrap). Everything it made is
# removed on exit (Ctrl-C, SIGTERM, or an error).
#
#   sudo deploy/testbed.sh CLUSTER.json [--no-daemons] [--workdir DIR] [-- extra join flags...]
#
# CLUSTER.json is the planner's cluster format (protocol/CLUSTER.md; e.g.
# fusionnode/plan/clusters/testbed-4-mixed.json), read with fusionnode.plan.cluster so the
# bandwidth of every pair is exactly what the planner assumes. Needs: root (or CAP_NET_ADMIN +
# CAP_SYS_ADMIN), iproute2 (`ip`, `tc`), the kernel's sch_tbf, python3 with fusionnode installed.
# Latency is NOT emulated (no netem here); only bandwidth. A device's uplink cap becomes a cap on
# each of its links, not one shared uplink.
#
# Addresses: only 10.77.0.0/16, and only inside the namespaces this script creates; link k (pair
# i<j) is 10.77.<k/64>.<4(k%64)+1>/30 on device i and .+2 on device j. Nothing in the caller's
# namespace is touched. It prints one line "TESTBED READY {json}" (namespaces, addresses, peers)
# when everything is up, then waits until signalled.
set -euo pipefail

MAX_DEVICES=16          # N(N-1)/2 veth pairs; 16 devices -> 120 links
JOIN_PORT=31337         # each daemon's libp2p port inside its namespace
READY_TIMEOUT_S=180     # seconds for a daemon to print its ready line
PREFIX="fntb$$"         # namespace names: fntb<pid>-<device index>

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
[[ $# -ge 1 ]] || usage
[[ "$1" == "-h" || "$1" == "--help" ]] && usage 0
CLUSTER="$1"; shift
DAEMONS=1
WORKDIR=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-daemons) DAEMONS=0; shift ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "testbed.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ $EUID -eq 0 ]] || { echo "testbed.sh: needs root (network namespaces and tc)" >&2; exit 2; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "testbed.sh: needs iproute2 (ip, tc)" >&2; exit 2; }
[[ -f "$CLUSTER" ]] || { echo "testbed.sh: no cluster file $CLUSTER" >&2; exit 2; }
[[ -n "$WORKDIR" ]] || WORKDIR="$(mktemp -d -t fusionnode-testbed.XXXXXX)"
mkdir -p "$WORKDIR"

NAMESPACES=()
PIDS=()
SLEEPER=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [[ -n "$SLEEPER" ]] && kill "$SLEEPER" 2>/dev/null
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  # deleting a namespace deletes its veth ends and qdiscs; also kill anything left inside it
  for ns in "${NAMESPACES[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  echo "testbed.sh: torn down ${#NAMESPACES[@]} namespace(s)" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# "N", then "dev ID" per device, then "link i j bps_ij bps_ji" per pair
mapfile -t LINES < <(python3 - "$CLUSTER" "$MAX_DEVICES" <<'PY'
import sys
from fusionnode.plan.cluster import load_cluster
c = load_cluster(sys.argv[1])
if c.size > int(sys.argv[2]):
    sys.exit(f"testbed.sh: {c.size} devices; at most {sys.argv[2]}")
print(c.size)
for d in c.devices:
    print("dev", d.id)
for i in range(c.size):
    for j in range(i + 1, c.size):
        print("link", i, j, int(c.bandwidth_bps[i, j]), int(c.bandwidth_bps[j, i]))
PY
)
N="${LINES[0]}"
IDS=()
for line in "${LINES[@]:1}"; do [[ $line == dev\ * ]] && IDS+=("${line#dev }"); done

for ((i = 0; i < N; i++)); do
  ns="$PREFIX-$i"
  # a namespace of this name is a dead run's (the name holds this process's pid; a run killed by
  # SIGKILL cannot tear down, and its pid is reused): its leftovers are removed, not failed on
  if ip netns list | grep -qx "$ns\( .*\)\?"; then
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
    echo "testbed.sh: removed namespace $ns, left by a dead run of the same pid" >&2
  fi
  ip netns add "$ns"
  NAMESPACES+=("$ns")
  ip -n "$ns" link set lo up
done

tbf() {  # tbf NS DEV RATE_BPS: shape egress to RATE_BPS bit/s; burst >= 10 ms of traffic
  local burst=$(( $3 / 800 > 16384 ? $3 / 800 : 16384 ))
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${3}bit" burst "$burst" latency 50ms
}

declare -A ADDR   # "i,j" -> address of device i on its link to j
LINKS_JSON=""
k=0
for line in "${LINES[@]:1}"; do
  [[ $line == link\ * ]] || continue
  read -r _ i j bij bji <<<"$line"
  a="10.77.$((k / 64)).$((4 * (k % 64) + 1))"
  b="10.77.$((k / 64)).$((4 * (k % 64) + 2))"
  # both ends are created directly inside their namespaces: nothing appears in the caller's
  ip -n "$PREFIX-$i" link add "to$j" type veth peer name "to$i" netns "$PREFIX-$j"
  ip -n "$PREFIX-$i" addr add "$a/30" dev "to$j"
  ip -n "$PREFIX-$j" addr add "$b/30" dev "to$i"
  ip -n "$PREFIX-$i" link set "to$j" up
  ip -n "$PREFIX-$j" link set "to$i" up
  tbf "$PREFIX-$i" "to$j" "$bij"
  tbf "$PREFIX-$j" "to$i" "$bji"
  ADDR["$i,$j"]="$a"; ADDR["$j,$i"]="$b"
  LINKS_JSON+="${LINKS_JSON:+,}{\"a\":$i,\"b\":$j,\"addr_a\":\"$a\",\"addr_b\":\"$b\",\"bps_ab\":$bij,\"bps_ba\":$bji}"
  k=$((k + 1))
done

wait_ready() {  # wait_ready LOGFILE PID -> prints the ready JSON
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  while ((SECONDS < deadline)); do
    if grep -m1 '^FUSIONNODE READY ' "$1" 2>/dev/null | sed 's/^FUSIONNODE READY //'; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "testbed.sh: daemon died, see $1" >&2; tail -20 "$1" >&2; return 1; }
    sleep 0.5
  done
  echo "testbed.sh: no ready line in $1 after ${READY_TIMEOUT_S} s" >&2
  return 1
}

PEERS_JSON=""
if ((DAEMONS)); then
  BOOT_ID=""
  for ((i = 0; i < N; i++)); do
    # no UPnP/NAT-PMP, AutoNAT or relay service: a daemon speaks only to the testbed's own addresses
    args=(join --state-dir "$WORKDIR/peer$i" --listen "/ip4/0.0.0.0/tcp/$JOIN_PORT"
          --nat-port-map off --autonat off --relay-service off)
    if ((i > 0)); then args+=(--initial-peers "/ip4/${ADDR[0,$i]}/tcp/$JOIN_PORT/p2p/$BOOT_ID"); fi
    ip netns exec "$PREFIX-$i" fusionnode "${args[@]}" "${EXTRA[@]}" >"$WORKDIR/peer$i.log" 2>&1 &
    PIDS+=($!)
    ready="$(wait_ready "$WORKDIR/peer$i.log" "${PIDS[-1]}")"
    if ((i == 0)); then
      BOOT_ID="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["peer_id"])' "$ready")"
    fi
    PEERS_JSON+="${PEERS_JSON:+,}$ready"
    echo "testbed.sh: device ${IDS[$i]} (namespace $PREFIX-$i) up" >&2
  done
fi

NS_JSON=""
for ((i = 0; i < N; i++)); do NS_JSON+="${NS_JSON:+,}{\"device\":\"${IDS[$i]}\",\"netns\":\"$PREFIX-$i\"}"; done
echo "TESTBED READY {\"workdir\":\"$WORKDIR\",\"devices\":[$NS_JSON],\"links\":[$LINKS_JSON],\"peers\":[$PEERS_JSON]}"
echo "testbed.sh: up; run commands with: ip netns exec $PREFIX-0 fusionnode status --state-dir $WORKDIR/peer0 ; Ctrl-C tears down" >&2
while true; do sleep 3600 & SLEEPER=$!; wait "$SLEEPER" || true; done
