#!/bin/bash
# Entrypoint of kvstream's Kafka image (docker/kafka/Dockerfile).
#
#   kafka.sh start    write the configuration, format the storage once, run the node
#   kafka.sh health   exit 0 once the broker serves clients (the image's health check)
#
# Configuration: a single KRaft node (defaults below) plus every KAFKA_* variable, as
# Apache's own image does: KAFKA_ADVERTISED_LISTENERS -> advertised.listeners (one "_" is
# a ".", "__" is a "_"). KAFKA_HEAP sets -Xmx, KAFKA_OPTS adds JVM options.
# KVSTREAM_KAFKA_ADVERTISED_FILE: wait for this file and take advertised.listeners from
# it; a test harness that maps the port at random writes it once the mapping is known.
set -euo pipefail

DATA=/var/lib/kafka/data
CONFIG=/var/lib/kafka/config/server.properties
OUT=/var/lib/kafka/kafka.out

die() { echo "kafka.sh: $*" >&2; exit 1; }

properties() {
    # Defaults: clients on 9092 advertised as localhost (override for other clients), the
    # broker's own traffic on 9094, the controller on 9093. Same topic settings as
    # ops/kafka/broker.sh's single node.
    cat <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=PLAINTEXT://:9092,BROKER://:9094,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092,BROKER://localhost:9094
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=BROKER
log.dirs=$DATA
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
background.threads=4
num.recovery.threads.per.data.dir=1
log.cleaner.dedupe.buffer.size=8388608
log.cleaner.threads=1
PROPS
    local var key
    for var in $(compgen -e | grep '^KAFKA_' || true); do
        case "$var" in KAFKA_HEAP|KAFKA_OPTS) continue ;; esac
        key="${var#KAFKA_}"
        key="${key//__/@}"
        key="${key//_/.}"
        key="${key//@/_}"
        echo "${key,,}=${!var}"
    done
    if [[ -n "${KVSTREAM_KAFKA_ADVERTISED_FILE:-}" ]]; then
        local deadline=$((SECONDS + 120))
        until [[ -s "$KVSTREAM_KAFKA_ADVERTISED_FILE" ]]; do
            ((SECONDS < deadline)) || die "no $KVSTREAM_KAFKA_ADVERTISED_FILE after 120 s"
            sleep 0.1
        done
        echo "advertised.listeners=$(<"$KVSTREAM_KAFKA_ADVERTISED_FILE")"
    fi
}

# The JVM command line shared by the storage tool and the node.
JAVA=()
set_java() {
    local -a opts
    read -r -a opts <<<"${KAFKA_OPTS:-}"
    JAVA=(java -Xms128m "-Xmx${KAFKA_HEAP:-512m}" "${opts[@]}" -Djava.awt.headless=true
        -Dkafka.logs.dir=/var/lib/kafka -Dkvstream.node=kafka
        -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties -cp '/opt/kafka/libs/*')
}

start() {
    # Later lines win in a properties file, so the variables override the defaults.
    properties >"$CONFIG"
    set_java
    if [[ ! -f "$DATA/meta.properties" ]]; then
        local id
        id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
        # A leading '-' would read as a flag.
        [[ "$id" == -* ]] && id="A${id:1}"
        "${JAVA[@]}" -XX:TieredStopAtLevel=1 -XX:+UseSerialGC kafka.tools.StorageTool format \
            -t "$id" -c "$CONFIG" >/dev/null || die "formatting $DATA failed"
    fi
    # The output also goes to a file that `health` reads ("Kafka Server started" comes once
    # the broker is unfenced, i.e. serves clients).
    : >"$OUT"
    exec "${JAVA[@]}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 kafka.Kafka "$CONFIG" > >(tee -a "$OUT") 2>&1
}

health() {
    grep -q "Kafka Server started" "$OUT" 2>/dev/null && (exec 3<>/dev/tcp/127.0.0.1/9092) 2>/dev/null
}

case "${1:-start}" in
    start) start ;;
    health) health ;;
    *) exec "$@" ;;
esac
