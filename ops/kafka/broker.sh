#!/usr/bin/env bash
# The local development/test Kafka: Apache Kafka in KRaft mode, run from the jars of
# org.apache.kafka:kafka_2.13 resolved from Maven Central (DESIGN.md §10).
#
#   broker.sh fetch                                   resolve the jars into the cache
#   broker.sh fetch-tools                             the same, and Kafka's tools' jars
#                                                     (kafka-tools: ACLs, consumer groups...)
#   broker.sh start [--brokers 1|3] [--dir DIR] [--owner-pid PID]
#                                                     format + launch; prints the bootstrap
#   broker.sh stop [--dir DIR]                        stop every node (TERM, then KILL)
#   broker.sh status [--dir DIR]                      one line per node; exit 3 unless all run
#   broker.sh kill-node --index N [--signal SIG] [--dir DIR]   signal one node (fault tests)
#   broker.sh start-node --index N [--dir DIR]        relaunch one stopped node, same config
#   broker.sh version                                 the pinned Kafka version
#   broker.sh tool NAME [ARGS...]                     run one of Kafka's own command-line
#                                                     tools (console-consumer, consumer-groups,
#                                                     get-offsets) against any cluster
#
# Every node is a combined broker+controller on free loopback ports; three nodes are one
# cluster with three controller voters. Environment: KVSTREAM_CACHE (cache root),
# KVSTREAM_BROKER_DIR (default --dir, else $KVSTREAM_CACHE/broker),
# KVSTREAM_KAFKA_HEAP (default 512m), KVSTREAM_KAFKA_OPTS (more JVM options, e.g. for
# debugging), KVSTREAM_BROKER_START_TIMEOUT (s, default 180),
# KVSTREAM_BROKER_STOP_TIMEOUT (s, default 20).
set -euo pipefail

KAFKA_VERSION="4.1.1"
SCALA_ARTIFACT="kafka_2.13"
# Kafka logs through SLF4J 1.x but its pom names no binding (the release tarball ships one):
# without this jar the broker logs nothing at all. Same version as Kafka's log4j-core.
LOG4J_VERSION="2.24.3"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${KVSTREAM_CACHE:-$HOME/.cache/kvstream}"
LIBS="$CACHE_ROOT/kafka/$KAFKA_VERSION/libs"
# Class-data-sharing archive of the classes a broker loads while starting: made once after the
# download, it cuts every later start-up (measured on a busy 2-core machine: one node in 4 s
# instead of 7-17 s, three nodes in 16 s instead of 21 s).
ARCHIVE="$CACHE_ROOT/kafka/$KAFKA_VERSION/broker.jsa"
# Keep in step with kvstream.kafka.local_broker.default_cluster_dir().
DEFAULT_DIR="${KVSTREAM_BROKER_DIR:-$CACHE_ROOT/broker}"
MARKER=".kvstream-broker"
HEAP="${KVSTREAM_KAFKA_HEAP:-512m}"
START_TIMEOUT="${KVSTREAM_BROKER_START_TIMEOUT:-180}"
STOP_TIMEOUT="${KVSTREAM_BROKER_STOP_TIMEOUT:-20}"

die() { echo "broker.sh: $*" >&2; exit 1; }
log() { echo "broker.sh: $*" >&2; }

# The header comment above is the help text.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# ---------------------------------------------------------------- jars

# resolve_into DEST WHAT DEPENDENCIES_XML: the runtime closure of the given Maven
# dependencies into DEST, resolved in a scratch folder and swapped in whole (with a
# .complete mark), so that a half-done download is never used. Callers hold a lock.
resolve_into() {
    local dest=$1 what=$2 deps=$3 work="$1.tmp.$$"
    rm -rf "$work" && mkdir -p "$work"
    cat >"$work/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>kvstream.local</groupId>
  <artifactId>$(basename "$dest")-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>$deps
  </dependencies>
</project>
EOF
    log "resolving $what"
    if ! mvn -B -q -f "$work/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$work/jars" >"$work/mvn.log" 2>&1; then
        tail -n 30 "$work/mvn.log" >&2
        die "could not resolve $what from Maven (log above)"
    fi
    rm -rf "$dest"
    mv "$work/jars" "$dest"
    rm -rf "$work"
    touch "$dest/.complete"
}

fetch() {
    [[ -f "$LIBS/.complete" && (-f "$ARCHIVE" || -n "${ARCHIVING:-}") ]] && return 0
    command -v mvn >/dev/null || die "mvn not found: install Maven (Debian package maven) to fetch Kafka"
    command -v java >/dev/null || die "java not found: install a Java 17+ runtime"
    local base="$CACHE_ROOT/kafka/$KAFKA_VERSION"
    mkdir -p "$base"
    # One fetch at a time (parallel test sessions share the cache).
    exec 9>"$base/.lock"
    flock 9
    if [[ ! -f "$LIBS/.complete" ]]; then
        local t0=$SECONDS
        resolve_into "$LIBS" "org.apache.kafka:$SCALA_ARTIFACT:$KAFKA_VERSION and its runtime dependencies" "
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>$SCALA_ARTIFACT</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>"
        log "fetched $(find "$LIBS" -name '*.jar' | wc -l) jars in $((SECONDS - t0)) s into $LIBS"
    fi
    if [[ ! -f "$ARCHIVE" && -z "${ARCHIVING:-}" ]]; then
        make_archive || log "no class-data archive made (start-ups stay slower): see above"
    fi
    flock -u 9
    # Closed, so that the brokers started next do not inherit it.
    exec 9>&-
}

# Start and stop a throw-away broker that dumps the classes it loaded when it exits.
make_archive() {
    local t0=$SECONDS tmp dump="$ARCHIVE.tmp.$$"
    tmp="$(mktemp -d)"
    log "making the class-data archive (once)"
    (
        export ARCHIVING=1 KVSTREAM_KAFKA_OPTS="-XX:ArchiveClassesAtExit=$dump"
        cmd_start --dir "$tmp" >/dev/null
        cmd_stop --dir "$tmp" 2>/dev/null
    ) || { rm -rf "$tmp" "$dump"; return 1; }
    rm -rf "$tmp"
    # Keep it only if a JVM can map it.
    if [[ -s "$dump" ]] && java -XX:SharedArchiveFile="$dump" -Xshare:on -cp "$(java_cp)" \
        -version >/dev/null 2>&1; then
        mv -f "$dump" "$ARCHIVE"
        log "class-data archive made in $((SECONDS - t0)) s"
    else
        rm -f "$dump"
        return 1
    fi
}

# ---------------------------------------------------------------- Kafka's own tools

# org.apache.kafka:kafka-tools is not a dependency of the broker jar: resolved on first use
# into its own folder, next to the broker's jars (which it shares at run time).
TOOLS="$CACHE_ROOT/kafka/$KAFKA_VERSION/tools"

fetch_tools() {
    fetch
    [[ -f "$TOOLS/.complete" ]] && return 0
    local base="$CACHE_ROOT/kafka/$KAFKA_VERSION"
    exec 8>"$base/.tools.lock"
    flock 8
    if [[ ! -f "$TOOLS/.complete" ]]; then
        resolve_into "$TOOLS" "org.apache.kafka:kafka-tools:$KAFKA_VERSION" "
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka-tools</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>"
    fi
    flock -u 8
    exec 8>&-
}

cmd_tool() {
    (($#)) || die "tool needs a NAME: console-consumer, consumer-groups or get-offsets"
    local name="$1" class
    shift
    case "$name" in
        console-consumer) class=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
        consumer-groups) class=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
        get-offsets) class=org.apache.kafka.tools.GetOffsetShell ;;
        *) die "unknown tool '$name' (console-consumer, consumer-groups, get-offsets)" ;;
    esac
    fetch_tools
    # The broker's jars first: the tools' copies of the jars both need are the same versions.
    exec java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
        -Dlog4j2.configurationFile="$HERE/log4j2-tools.properties" \
        -cp "$LIBS/*:$TOOLS/*" "$class" "$@"
}

# JVM options shared by every Kafka JVM: the class-data archive, where there is one.
cds_opts() {
    if [[ -f "$ARCHIVE" ]]; then echo "-XX:SharedArchiveFile=$ARCHIVE"; fi
}

# ---------------------------------------------------------------- helpers

# Free loopback TCP ports: bind port 0 and read back what the kernel chose.
free_ports() {
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# A Kafka cluster id: 16 random bytes, URL-safe base64 without padding.
cluster_id() {
    local id
    while :; do
        id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
        # A leading '-' would read as a command-line flag.
        [[ "$id" != -* ]] && { echo "$id"; return; }
    done
}

java_cp() { echo "$LIBS/*"; }

# Alive and not a zombie: an exited node whose parent has not reaped it still answers kill -0.
is_alive() {
    local state
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" || return 1
    [[ -n "$state" && "$state" != Z ]]
}

# The pid of node N if that process is alive AND is our Kafka for this DIR (a stale pid file
# may name a recycled pid).
node_pid() {
    local dir="$1" n="$2" pid
    [[ -f "$dir/node-$n.pid" ]] || return 1
    pid="$(<"$dir/node-$n.pid")"
    [[ "$pid" =~ ^[0-9]+$ ]] && is_alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$dir/node-$n/server.properties" || return 1
    echo "$pid"
}

node_count() { [[ -f "$1/brokers" ]] && cat "$1/brokers" || echo 0; }

launch_node() {
    local dir="$1" n="$2"
    local props="$dir/node-$n/server.properties"
    [[ -f "$props" ]] || die "$props missing: start the cluster first"
    mkdir -p "$dir/logs"
    # setsid: the node does not die with the caller's terminal or process group (the
    # watchdog and `stop` own its lifetime).
    local -a extra cds
    read -r -a extra <<<"${KVSTREAM_KAFKA_OPTS:-}"
    read -r -a cds <<<"$(cds_opts)"
    setsid java -Xms128m -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
        -Djava.awt.headless=true "${cds[@]}" "${extra[@]}" \
        -Dkafka.logs.dir="$dir/logs" -Dkvstream.node="node-$n" \
        -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -cp "$(java_cp)" kafka.Kafka "$props" \
        >>"$dir/logs/node-$n.out" 2>&1 </dev/null &
    echo $! >"$dir/node-$n.pid"
}

# Wait until node N logs that its broker is up; with KRaft that line comes after the broker
# is unfenced, i.e. it serves clients.
wait_node() {
    local dir="$1" n="$2" deadline=$((SECONDS + START_TIMEOUT))
    local port
    port="$(sed -n 's/^kvstream.client.port=//p' "$dir/node-$n/server.properties")"
    while ((SECONDS < deadline)); do
        # Plain liveness: right after launch the pid may still be the shell that is about
        # to exec java, so node_pid's command-line check would not match yet.
        if ! is_alive "$(<"$dir/node-$n.pid")"; then
            tail -n 40 "$dir/logs/node-$n.out" >&2 || true
            die "node $n exited during start-up (log: $dir/logs/node-$n.out)"
        fi
        if grep -q "Kafka Server started" "$dir/logs/node-$n.out" 2>/dev/null \
            && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.2
    done
    tail -n 40 "$dir/logs/node-$n.out" >&2 || true
    die "node $n did not come up within ${START_TIMEOUT}s (log: $dir/logs/node-$n.out)"
}

write_config() {
    local dir="$1" n="$2" brokers="$3" client_port="$4" controller_port="$5" voters="$6"
    local rf=$((brokers < 3 ? brokers : 3))
    local isr=$((rf < 2 ? rf : 2))
    mkdir -p "$dir/node-$n/data"
    cat >"$dir/node-$n/server.properties" <<EOF
# Written by ops/kafka/broker.sh; recreated at every start.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$client_port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$client_port
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/node-$n/data
# Topics are created on purpose (kvstream topics create), never by a typo.
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=$rf
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
# Tests form groups and expect them at once.
group.initial.rebalance.delay.ms=0
# Fault tests: a killed node is fenced and its partitions move after 6 s, not 9 s.
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
# Small machines: few threads, a small cleaner buffer (the default takes 128 MB of heap).
num.network.threads=2
num.io.threads=4
background.threads=4
num.recovery.threads.per.data.dir=1
log.cleaner.dedupe.buffer.size=8388608
log.cleaner.threads=1
# Not a Kafka setting (Kafka ignores unknown keys): read back by wait_node and status.
kvstream.client.port=$client_port
EOF
}

format_node() {
    local dir="$1" n="$2" id="$3"
    # A short-lived tool: C1 only and the serial collector spend less CPU on start-up.
    local -a cds
    read -r -a cds <<<"$(cds_opts)"
    java -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC "${cds[@]}" -cp "$(java_cp)" -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
        -Dkafka.logs.dir="$dir/logs" -Dkvstream.node="format-$n" \
        kafka.tools.StorageTool format -t "$id" -c "$dir/node-$n/server.properties" \
        >>"$dir/logs/format-$n.out" 2>&1 \
        || { cat "$dir/logs/format-$n.out" >&2; die "formatting node $n failed"; }
}

bootstrap_of() {
    local dir="$1" n brokers out=""
    brokers="$(node_count "$dir")"
    for ((n = 1; n <= brokers; n++)); do
        out+="${out:+,}127.0.0.1:$(sed -n 's/^kvstream.client.port=//p' "$dir/node-$n/server.properties")"
    done
    echo "$out"
}

# Stops the cluster when the owner process is gone, so that a killed test session leaves no
# broker behind. Runs detached; `stop` ends it.
start_watchdog() {
    local dir="$1" owner="$2"
    setsid bash -c '
        while s="$(awk "{print \$3}" "/proc/$1/stat" 2>/dev/null)" && [[ -n "$s" && "$s" != Z ]]; do
            sleep 2
        done
        exec bash "$2" stop --dir "$3"
    ' watchdog "$owner" "${BASH_SOURCE[0]}" "$dir" >>"$dir/logs/watchdog.out" 2>&1 </dev/null &
    echo $! >"$dir/watchdog.pid"
}

stop_watchdog() {
    local dir="$1" pid
    [[ -f "$dir/watchdog.pid" ]] || return 0
    pid="$(<"$dir/watchdog.pid")"
    # The watchdog may be what runs this stop; it must not kill itself mid-way.
    if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] \
        && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir"; then
        kill -TERM "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/watchdog.pid"
}

# ---------------------------------------------------------------- commands

cmd_start() {
    local brokers=1 dir="$DEFAULT_DIR" owner=""
    while (($#)); do
        case "$1" in
            --brokers) brokers="${2:?--brokers needs a value}"; shift 2 ;;
            --dir) dir="${2:?--dir needs a value}"; shift 2 ;;
            --owner-pid) owner="${2:?--owner-pid needs a value}"; shift 2 ;;
            *) die "start: unknown argument '$1'" ;;
        esac
    done
    [[ "$brokers" == 1 || "$brokers" == 3 ]] || die "--brokers must be 1 or 3, not '$brokers'"
    [[ -z "$owner" || "$owner" =~ ^[0-9]+$ ]] || die "--owner-pid must be a pid, not '$owner'"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"

    # Refuse to clear a folder that is not ours.
    if [[ -n "$(ls -A "$dir")" && ! -f "$dir/$MARKER" ]]; then
        die "$dir is not empty and was not made by broker.sh; choose another --dir"
    fi
    local running=0 n
    for ((n = 1; n <= $(node_count "$dir"); n++)); do
        node_pid "$dir" "$n" >/dev/null && running=$((running + 1))
    done
    if ((running > 0)); then
        if ((running == $(node_count "$dir") && running == brokers)); then
            log "already running in $dir"
            bootstrap_of "$dir"
            return 0
        fi
        die "$dir has $running of $(node_count "$dir") nodes running (asked for $brokers);" \
            "run 'stop --dir $dir' first"
    fi
    # A watchdog left from a cluster whose nodes were killed would stop the new one.
    stop_watchdog "$dir"

    fetch
    # A fresh cluster every start: old data of a previous run is dropped.
    rm -rf "$dir"/node-* "$dir"/logs "$dir"/bootstrap "$dir"/brokers "$dir"/*.pid
    touch "$dir/$MARKER"
    mkdir -p "$dir/logs"

    local ports voters="" id
    read -r -a ports <<<"$(free_ports $((2 * brokers)))"
    ((${#ports[@]} == 2 * brokers)) || die "could not find free loopback ports"
    for ((n = 1; n <= brokers; n++)); do
        voters+="${voters:+,}$n@127.0.0.1:${ports[2 * n - 1]}"
    done
    for ((n = 1; n <= brokers; n++)); do
        write_config "$dir" "$n" "$brokers" "${ports[2 * n - 2]}" "${ports[2 * n - 1]}" "$voters"
    done
    echo "$brokers" >"$dir/brokers"

    id="$(cluster_id)"
    local pids=()
    for ((n = 1; n <= brokers; n++)); do
        format_node "$dir" "$n" "$id" & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || die "formatting storage failed"; done

    # From here on a failure must not leave half a cluster running.
    trap 'cmd_stop --dir "$dir" >/dev/null 2>&1 || true' EXIT
    for ((n = 1; n <= brokers; n++)); do launch_node "$dir" "$n"; done
    if [[ -n "$owner" ]]; then start_watchdog "$dir" "$owner"; fi
    for ((n = 1; n <= brokers; n++)); do wait_node "$dir" "$n"; done
    trap - EXIT

    bootstrap_of "$dir" | tee "$dir/bootstrap"
}

cmd_stop() {
    local dir="$DEFAULT_DIR"
    while (($#)); do
        case "$1" in
            --dir) dir="${2:?--dir needs a value}"; shift 2 ;;
            *) die "stop: unknown argument '$1'" ;;
        esac
    done
    [[ -d "$dir" ]] || { log "nothing to stop: $dir does not exist"; return 0; }
    dir="$(cd "$dir" && pwd)"
    local n pid pids=() brokers
    brokers="$(node_count "$dir")"
    for ((n = 1; n <= brokers; n++)); do
        if pid="$(node_pid "$dir" "$n")"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    local deadline=$((SECONDS + STOP_TIMEOUT)) alive
    while :; do
        alive=()
        for pid in "${pids[@]}"; do is_alive "$pid" && alive+=("$pid"); done
        ((${#alive[@]} == 0)) && break
        if ((SECONDS >= deadline)); then
            log "escalating to SIGKILL for ${alive[*]}"
            kill -KILL "${alive[@]}" 2>/dev/null || true
            deadline=$((SECONDS + 10))
            sleep 0.2
            continue
        fi
        sleep 0.2
    done
    stop_watchdog "$dir"
    rm -f "$dir"/node-*.pid "$dir/bootstrap"
    log "stopped ${#pids[@]} node(s) in $dir"
}

cmd_status() {
    local dir="$DEFAULT_DIR"
    while (($#)); do
        case "$1" in
            --dir) dir="${2:?--dir needs a value}"; shift 2 ;;
            *) die "status: unknown argument '$1'" ;;
        esac
    done
    local brokers n pid down=0
    brokers="$(node_count "$dir")"
    ((brokers > 0)) || { echo "no cluster in $dir"; return 3; }
    for ((n = 1; n <= brokers; n++)); do
        if pid="$(node_pid "$dir" "$n")"; then
            echo "node $n running pid=$pid"
        else
            echo "node $n stopped"
            down=$((down + 1))
        fi
    done
    echo "bootstrap $(bootstrap_of "$dir")"
    ((down == 0)) || return 3
}

cmd_kill_node() {
    local dir="$DEFAULT_DIR" index="" sig="TERM" pid
    while (($#)); do
        case "$1" in
            --dir) dir="${2:?--dir needs a value}"; shift 2 ;;
            --index) index="${2:?--index needs a value}"; shift 2 ;;
            --signal) sig="${2:?--signal needs a value}"; shift 2 ;;
            *) die "kill-node: unknown argument '$1'" ;;
        esac
    done
    [[ "$index" =~ ^[0-9]+$ ]] || die "kill-node needs --index N"
    dir="$(cd "$dir" && pwd)"
    pid="$(node_pid "$dir" "$index")" || die "node $index in $dir is not running"
    kill -s "$sig" "$pid" || die "could not send SIG$sig to node $index (pid $pid)"
    # Return once the node is gone, unless the signal does not end it (e.g. STOP).
    case "$sig" in
        TERM|KILL|INT|SIGTERM|SIGKILL|SIGINT|9|15|2)
            while is_alive "$pid"; do sleep 0.1; done ;;
    esac
}

cmd_start_node() {
    local dir="$DEFAULT_DIR" index=""
    while (($#)); do
        case "$1" in
            --dir) dir="${2:?--dir needs a value}"; shift 2 ;;
            --index) index="${2:?--index needs a value}"; shift 2 ;;
            *) die "start-node: unknown argument '$1'" ;;
        esac
    done
    [[ "$index" =~ ^[0-9]+$ ]] || die "start-node needs --index N"
    dir="$(cd "$dir" && pwd)"
    ((index >= 1 && index <= $(node_count "$dir"))) || die "no node $index in $dir"
    node_pid "$dir" "$index" >/dev/null && die "node $index in $dir is already running"
    fetch
    # Only lines written after this relaunch count as "started".
    mv -f "$dir/logs/node-$index.out" "$dir/logs/node-$index.out.prev" 2>/dev/null || true
    launch_node "$dir" "$index"
    wait_node "$dir" "$index"
}

main() {
    (($#)) || usage
    local cmd="$1"
    shift
    case "$cmd" in
        fetch) fetch; echo "$LIBS" ;;
        fetch-tools) fetch_tools; echo "$TOOLS" ;;
        start) cmd_start "$@" ;;
        stop) cmd_stop "$@" ;;
        status) cmd_status "$@" ;;
        kill-node) cmd_kill_node "$@" ;;
        start-node) cmd_start_node "$@" ;;
        version) echo "$KAFKA_VERSION" ;;
        tool) cmd_tool "$@" ;;
        -h|--help|help) usage ;;
        *) die "unknown command '$cmd'" ;;
    esac
}

main "$@"
