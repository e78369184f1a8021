#!/usr/bin/env bash
# Emulated bandwidth-limited MPI cluster on one machine (needs root).
#
#   cluster.sh up N [--bandwidth 100mbit] [--prefix hgc] [--latency 5ms] [--offload]
#   cluster.sh down [--prefix hgc]
#   cluster.sh mpirun [--prefix hgc] -- MPIRUN_ARGS...
#   cluster.sh counters [--prefix hgc]
#   cluster.sh run N [--bandwidth B] [--prefix hgc] [--latency L] [--offload] -- MPIRUN_ARGS...
#   cluster.sh info [--prefix hgc]
#
# Layout (see docs/cluster.md):
#   PREFIX-sw   network namespace holding the bridge PREFIX-br0 (198.18.0.1/24); mpirun runs here
#   PREFIX-hI   one network namespace per host I, interface PREFIX-eI = 198.18.0.(10+I)/24,
#               veth peer PREFIX-pI enslaved to PREFIX-br0 in PREFIX-sw
#   tbf on PREFIX-eI (host sends) and on PREFIX-pI (host receives).
# Nothing is created in the root network namespace, and only 198.18.0.0/24 (inside the benchmarking
# range 198.18.0.0/15) is ever addressed. State (hostfile, rsh agent) lives in
# ${HGSGC_CLUSTER_STATE:-/tmp/hgsgc-cluster}/PREFIX/.
#
# Exit codes: 0 ok; 1 usage or runtime error; 2 refused (not root, no usable `ip netns`, netem
# missing for --latency); `mpirun` and `run` return mpirun's exit code.
set -euo pipefail

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
STATE_ROOT="${HGSGC_CLUSTER_STATE:-/tmp/hgsgc-cluster}"
NET_PREFIX="198.18.0"          # the /24 used inside every cluster (198.18.0.0/15 is for benchmarks)
SUBNET="$NET_PREFIX.0/24"
SW_ADDR="$NET_PREFIX.1"
HOST_BASE=10                   # host I gets $NET_PREFIX.(HOST_BASE + I)
MAX_HOSTS=240
DEFAULT_PREFIX="hgc"
DEFAULT_BANDWIDTH="100mbit"

err() { echo "cluster.sh: $*" >&2; }
die() { err "$*"; exit 1; }
refuse() { err "refused: $*"; exit 2; }
usage() { sed -n '2,9p' "$SELF" | sed 's/^# \{0,1\}//' >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# preconditions
require_root() {
  local uid="${HGSGC_CLUSTER_FAKE_UID:-$(id -u)}"
  [ "$uid" = "0" ] || refuse "must run as root (uid is $uid): network namespaces, veth and tc need CAP_NET_ADMIN; use sudo"
  command -v ip >/dev/null 2>&1 || refuse "'ip' (iproute2) not found in PATH"
  command -v tc >/dev/null 2>&1 || refuse "'tc' (iproute2) not found in PATH"
  local out
  out="$(ip netns list 2>&1)" || refuse "'ip netns' is not usable here: $(echo "$out" | head -n1)"
}

check_prefix() {
  [[ "$1" =~ ^[a-z][a-z0-9]{0,9}$ ]] \
    || die "bad prefix '$1': 1-10 characters [a-z0-9], starting with a letter (interface names are limited to 15 characters)"
}

state_dir() { echo "$STATE_ROOT/$1"; }
sw_ns() { echo "$1-sw"; }

# namespaces / root-namespace links that belong to prefix $1 (exact pattern, so "hgc" never
# matches another prefix such as "hgct1")
our_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$1-(h[0-9]+|sw)\$" || true; }
our_root_links() {
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
    | grep -E "^$1-(e[0-9]+|p[0-9]+|br0)\$" || true
}

is_up() { [ -f "$(state_dir "$1")/hosts" ] && ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$(sw_ns "$1")"; }
require_up() { is_up "$1" || die "cluster '$1' is not up (run: cluster.sh up N --prefix $1)"; }

# tc rate string -> bytes per second (integer); empty on parse error
rate_to_Bps() {
  awk -v r="$1" 'BEGIN {
    if (match(r, /^[0-9]+(\.[0-9]+)?/) == 0) exit 1
    v = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
    m["bit"]=1/8; m["kbit"]=1e3/8; m["mbit"]=1e6/8; m["gbit"]=1e9/8; m["tbit"]=1e12/8
    m["kibit"]=1024/8; m["mibit"]=1048576/8; m["gibit"]=1073741824/8
    m["bps"]=1; m["kbps"]=1e3; m["mbps"]=1e6; m["gbps"]=1e9
    m["kibps"]=1024; m["mibps"]=1048576; m["gibps"]=1073741824
    if (!(u in m)) exit 1
    printf "%d\n", v * m[u]
  }'
}

# ---------------------------------------------------------------------------------------------
# down
cmd_down() {
  local prefix="$DEFAULT_PREFIX"
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      *) die "down: unknown argument '$1'" ;;
    esac
  done
  check_prefix "$prefix"
  require_root
  teardown "$prefix"
  echo "cluster '$prefix' down"
}

teardown() {
  local prefix="$1" ns pids l
  for ns in $(our_netns "$prefix"); do
    # leftover processes (orted, ranks) pin the namespace and its links: end them, by pid
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    if [ -n "${pids// /}" ]; then
      kill -TERM $pids 2>/dev/null || true
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
        [ -z "${pids// /}" ] && break
        sleep 0.2
      done
      [ -n "${pids// /}" ] && kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
  done
  for l in $(our_root_links "$prefix"); do ip link del "$l" 2>/dev/null || true; done
  rm -rf "$(state_dir "$prefix")"
}

# ---------------------------------------------------------------------------------------------
# up
probe_netem() {  # $1: a namespace of ours to probe in
  tc -n "$1" qdisc add dev lo root netem delay 1ms >/dev/null 2>&1 || return 1
  tc -n "$1" qdisc del dev lo root >/dev/null 2>&1 || true
  return 0
}

# IPv4 only: no link-local IPv6 addresses, so no router solicitations / MLD reports on the links
no_ipv6() {
  ip netns exec "$1" sh -c 'for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6; do [ ! -w "$f" ] || echo 1 > "$f"; done'
}

cmd_up() {
  local n="" prefix="$DEFAULT_PREFIX" bw="$DEFAULT_BANDWIDTH" latency="" offload=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      --bandwidth) bw="${2:?--bandwidth needs a value}"; shift 2 ;;
      --latency) latency="${2:?--latency needs a value}"; shift 2 ;;
      --offload) offload=1; shift ;;
      --*) die "up: unknown option '$1'" ;;
      *) [ -z "$n" ] || die "up: unexpected argument '$1'"; n="$1"; shift ;;
    esac
  done
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_HOSTS" ] \
    || die "up: N must be an integer in 1..$MAX_HOSTS (got '${n}')"
  check_prefix "$prefix"
  local rate_Bps="" burst=""
  case "$bw" in
    none|0|unlimited) bw="none" ;;
    *) rate_Bps="$(rate_to_Bps "$bw")" || die "up: cannot parse --bandwidth '$bw' (e.g. 100mbit, 1gbit, 500kbit)"
       [ "$rate_Bps" -gt 0 ] || die "up: --bandwidth must be > 0"
       # bucket: 2 ms of traffic, at least 10 full frames (must hold one MTU; tbf segments bigger GSO skbs)
       burst=$(( rate_Bps / 500 )); [ "$burst" -ge 15140 ] || burst=15140 ;;
  esac
  require_root
  is_up "$prefix" && die "up: cluster '$prefix' is already up (cluster.sh down --prefix $prefix first)"
  [ -z "$(our_netns "$prefix")$(our_root_links "$prefix")" ] && [ ! -e "$(state_dir "$prefix")" ] \
    || { err "up: removing leftovers of an earlier cluster '$prefix'"; teardown "$prefix"; }

  local sw; sw="$(sw_ns "$prefix")"
  local out
  out="$(ip netns add "$sw" 2>&1)" \
    || refuse "cannot create network namespaces ('ip netns add $sw' failed: $(echo "$out" | head -n1))"
  # from here on, any failure or interrupt removes what was created
  TRAP_PREFIX="$prefix"
  trap 'rc=$?; trap - EXIT INT TERM; err "up failed, tearing down $TRAP_PREFIX"; teardown "$TRAP_PREFIX"; exit $(( rc == 130 || rc == 143 ? rc : 1 ))' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM

  if [ -n "$latency" ]; then
    probe_netem "$sw" || { trap - EXIT INT TERM; teardown "$prefix";
      refuse "--latency $latency needs the netem qdisc, which this kernel does not have (tc: 'Specified qdisc kind is unknown'); only --bandwidth (tbf) can be emulated here"; }
  fi

  no_ipv6 "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add "$prefix-br0" type bridge
  ip -n "$sw" addr add "$SW_ADDR/24" dev "$prefix-br0"
  ip -n "$sw" link set "$prefix-br0" up

  local sd; sd="$(state_dir "$prefix")"
  mkdir -p "$sd"; chmod 755 "$STATE_ROOT" "$sd"
  : > "$sd/hostfile.tmp"; : > "$sd/hosts.tmp"
  local i ns hif pif addr
  for (( i = 0; i < n; i++ )); do
    ns="$prefix-h$i"; hif="$prefix-e$i"; pif="$prefix-p$i"; addr="$NET_PREFIX.$(( HOST_BASE + i ))"
    ip netns add "$ns"
    no_ipv6 "$ns"
    ip link add "$hif" netns "$ns" type veth peer name "$pif" netns "$sw"
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$addr/24" dev "$hif"
    ip -n "$sw" link set "$pif" master "$prefix-br0"
    if [ "$offload" = 0 ]; then
      # one MSS per skb, so the interface counters see one Ethernet/IP/TCP header per wire frame,
      # as a real NIC would put on the wire after TSO
      ip -n "$ns" link set dev "$hif" gso_max_segs 1
      ip -n "$sw" link set dev "$pif" gso_max_segs 1
    fi
    if [ "$bw" != "none" ]; then
      if [ -n "$latency" ]; then
        tc -n "$ns" qdisc add dev "$hif" root handle 1: tbf rate "$bw" burst "$burst" latency 50ms
        tc -n "$ns" qdisc add dev "$hif" parent 1:1 handle 10: netem delay "$latency"
      else
        tc -n "$ns" qdisc add dev "$hif" root tbf rate "$bw" burst "$burst" latency 50ms
      fi
      tc -n "$sw" qdisc add dev "$pif" root tbf rate "$bw" burst "$burst" latency 50ms
    elif [ -n "$latency" ]; then
      tc -n "$ns" qdisc add dev "$hif" root netem delay "$latency"
    fi
    ip -n "$ns" link set "$hif" up
    ip -n "$sw" link set "$pif" up
    echo "$ns slots=1" >> "$sd/hostfile.tmp"
    echo "$ns $hif $addr $pif" >> "$sd/hosts.tmp"
  done
  write_agent "$prefix" "$sd/agent"
  {
    echo "N=$n"; echo "PREFIX=$prefix"; echo "BANDWIDTH=$bw"; echo "LATENCY=${latency:-none}"
    echo "OFFLOAD=$offload"; echo "SUBNET=$SUBNET"; echo "SWITCH_NS=$sw"; echo "SWITCH_ADDR=$SW_ADDR"
  } > "$sd/meta"
  mv "$sd/hostfile.tmp" "$sd/hostfile"
  mv "$sd/hosts.tmp" "$sd/hosts"
  trap - EXIT INT TERM
  echo "cluster '$prefix' up: $n hosts, bandwidth $bw, latency ${latency:-none}, subnet $SUBNET"
  echo "hostfile $sd/hostfile"
  echo "agent $sd/agent"
}

write_agent() {  # $1 prefix, $2 path
  cat > "$2.tmp" <<EOF
#!/usr/bin/env bash
# rsh agent for Open MPI (written by cluster.sh for cluster '$1'), called like ssh:
#   agent [ssh options] [user@]HOST [COMMAND...]
# HOST is a namespace name ($1-hI) or its address ($NET_PREFIX.(${HOST_BASE}+I)); COMMAND runs there
# under /bin/sh -c, as ssh would run it under the remote login shell.
PREFIX='$1'
STATE_DIR='$(state_dir "$1")'
NET_PREFIX='$NET_PREFIX'
HOST_BASE=$HOST_BASE
EOF
  cat >> "$2.tmp" <<'EOF'
# ssh options that take an argument (ssh(1)); all others are flags and can be clustered (-xT)
ARG_OPTS="BbcDEeFIiJLlmOopQRSWw"
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -?*)
      opt="${1#-}"; shift
      while [ -n "$opt" ]; do
        c="${opt:0:1}"; opt="${opt:1}"
        if [[ "$ARG_OPTS" == *"$c"* ]]; then
          [ -n "$opt" ] || shift   # argument is the next word, else the rest of this word
          break
        fi
      done ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "agent: no host given" >&2; exit 255; }
host="${1#*@}"; shift
case "$host" in
  "$PREFIX"-h[0-9]*) ns="$host" ;;
  "$NET_PREFIX".[0-9]*) ns="$PREFIX-h$(( ${host##*.} - HOST_BASE ))" ;;
  *) echo "agent: host '$host' is not part of emulated cluster '$PREFIX'" >&2; exit 255 ;;
esac
[ -e "/run/netns/$ns" ] || { echo "agent: namespace '$ns' does not exist (is cluster '$PREFIX' up?)" >&2; exit 255; }
# a TMPDIR per host: Open MPI's session directories of different "hosts" must not collide
export TMPDIR="$STATE_DIR/tmp/$ns"
mkdir -p "$TMPDIR"
if [ $# -eq 0 ]; then exec ip netns exec "$ns" /bin/sh -l; fi
exec ip netns exec "$ns" /bin/sh -c "$*"
EOF
  chmod 755 "$2.tmp"; mv "$2.tmp" "$2"
}

# ---------------------------------------------------------------------------------------------
# mpirun
FORWARD_VARS="PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV PYTHONHASHSEED PYTHONUNBUFFERED HOME"
FORWARD_PATTERN='^(OMP|TF|KMP|MKL|OPENBLAS|HOROVOD|HGSGC)_[A-Za-z0-9_]*$'

cmd_mpirun() {
  local prefix="$DEFAULT_PREFIX"
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      --) shift; break ;;
      *) die "mpirun: unknown argument '$1' (put mpirun's own arguments after --)" ;;
    esac
  done
  check_prefix "$prefix"
  require_root
  require_up "$prefix"
  run_mpirun "$prefix" "$@"
}

run_mpirun() {
  local prefix="$1"; shift
  local sd; sd="$(state_dir "$prefix")"
  # Session directories: every namespace shares /tmp and the hostname, so with Open MPI's default
  # (/tmp/ompi.HOST.UID) the daemons of different hosts race creating the same directories
  # ("mkdir ... File exists") and other mpiruns on the machine may remove ours. Each host gets its
  # own TMPDIR instead ($sd/tmp/NAMESPACE, set by the agent; mpirun's is $sd/tmp/PREFIX-sw).
  mkdir -p "$sd/tmp/$(sw_ns "$prefix")"
  local -a xs=() v
  for v in $FORWARD_VARS $(compgen -e | grep -E "$FORWARD_PATTERN" | grep -v '^HGSGC_CLUSTER_FAKE_UID$' || true); do
    [ -n "${!v+x}" ] && xs+=(-x "$v")
  done
  # a caller that initialised MPI itself (e.g. `from mpi4py import MPI` in a test process, or a
  # rank) leaves singleton/launch variables in the environment that break a fresh mpirun
  for v in $(compgen -e); do
    case "$v" in
      OMPI_MCA_ess|OMPI_MCA_ess_*|OMPI_MCA_orte_*|OMPI_MCA_pmix|OMPI_MCA_pmix_*) unset "$v" ;;
      OMPI_MCA_*) ;;                                   # the user's own MCA settings stay
      PMIX_*|ORTE_*|OMPI_*) unset "$v" ;;
    esac
  done
  # --bind-to none: every emulated host is a "node" with one slot, so Open MPI's default binding
  # (bind to core when the job has <= 2 ranks) bound the rank of EVERY host to core 0 of this
  # machine: both ranks of a 2-host cell shared one core (HGSGC_PIN_CORES then found only core 0
  # in its mask). Unbound, ranks float over all cores, or pin themselves (hgsgc.runtime.pin_to_core).
  local -a cmd=(ip netns exec "$(sw_ns "$prefix")" mpirun
    --allow-run-as-root
    --hostfile "$sd/hostfile" --map-by node --bind-to none
    --mca plm_rsh_agent "$sd/agent"
    --mca plm_rsh_no_tree_spawn 1
    --mca orte_leave_session_attached 1
    --mca rtc_hwloc_vmhole none
    --mca pml ob1 --mca osc ^ucx
    --mca btl tcp,self
    --mca btl_tcp_if_include "$SUBNET"
    --mca oob_tcp_if_include "$SUBNET"
    "${xs[@]}"
    "$@")
  # Daemons stay attached to their agent (no --daemonize), so a daemon that dies at startup
  # fails mpirun at once instead of leaving it waiting forever. The agent's `sh` is /bin/sh: tell
  # Open MPI to write sh syntax. mpirun's stderr goes through a filter that drops one benign
  # warning of the rsh launcher ("setpgid ... failed in parent": the agent had already exec'd).
  local rc
  set +e
  { TMPDIR="$sd/tmp/$(sw_ns "$prefix")" SHELL=/bin/sh "${cmd[@]}" 2>&1 1>&3 3>&- \
      | grep --line-buffered -v 'plm:rsh: Warning: setpgid(' >&2; } 3>&1
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# ---------------------------------------------------------------------------------------------
# counters / info
cmd_counters() {
  local prefix="$DEFAULT_PREFIX"
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      *) die "counters: unknown argument '$1'" ;;
    esac
  done
  check_prefix "$prefix"
  require_root
  require_up "$prefix"
  local ns hif addr pif first=1 vals
  printf '{'
  while read -r ns hif addr pif; do
    vals="$(ip netns exec "$ns" sh -c "cd /sys/class/net/$hif/statistics && cat tx_bytes rx_bytes tx_packets rx_packets tx_dropped rx_dropped" | tr '\n' ' ')" \
      || die "counters: cannot read /sys/class/net/$hif/statistics in $ns"
    set -- $vals
    [ "$first" = 1 ] || printf ', '
    first=0
    printf '"%s": {"interface": "%s", "address": "%s", "tx_bytes": %s, "rx_bytes": %s, "tx_packets": %s, "rx_packets": %s, "tx_dropped": %s, "rx_dropped": %s}' \
      "$ns" "$hif" "$addr" "$1" "$2" "$3" "$4" "$5" "$6"
  done < "$(state_dir "$prefix")/hosts"
  printf '}\n'
}

cmd_info() {
  local prefix="$DEFAULT_PREFIX"
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      *) die "info: unknown argument '$1'" ;;
    esac
  done
  check_prefix "$prefix"
  require_up "$prefix"
  local sd; sd="$(state_dir "$prefix")"
  cat "$sd/meta"; echo "HOSTFILE=$sd/hostfile"; echo "AGENT=$sd/agent"
}

# ---------------------------------------------------------------------------------------------
# run: up + mpirun + down, teardown guaranteed
cmd_run() {
  local prefix="$DEFAULT_PREFIX"
  local -a up_args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="${2:?--prefix needs a value}"; shift 2 ;;
      --bandwidth|--latency) up_args+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
      --offload) up_args+=("$1"); shift ;;
      --) shift; break ;;
      --*) die "run: unknown option '$1'" ;;
      *) up_args+=("$1"); shift ;;
    esac
  done
  [ $# -gt 0 ] || die "run: nothing to run (cluster.sh run N [options] -- PROGRAM ARGS...)"
  # (up's report goes to stderr: stdout is the program's; up removes what it made if it fails)
  cmd_up "${up_args[@]}" --prefix "$prefix" >&2
  TRAP_PREFIX="$prefix"
  trap 'rc=$?; trap - EXIT INT TERM; teardown "$TRAP_PREFIX"; err "cluster $TRAP_PREFIX down"; exit $rc' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local rc=0
  run_mpirun "$prefix" "$@" || rc=$?
  exit "$rc"
}

# ---------------------------------------------------------------------------------------------
[ $# -ge 1 ] || usage
sub="$1"; shift
case "$sub" in
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  mpirun) cmd_mpirun "$@" ;;
  counters) cmd_counters "$@" ;;
  info) cmd_info "$@" ;;
  run) cmd_run "$@" ;;
  -h|--help|help) usage ;;
  *) err "unknown subcommand '$sub'"; usage ;;
esac
