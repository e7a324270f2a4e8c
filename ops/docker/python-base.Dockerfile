# The stand-in for python:3.11-slim-bookworm that ops/docker/build-bases.sh makes from
# Debian's packages: CPython 3.11 with venv and the CA certificates.
ARG DEBIAN_BASE=debian:bookworm-slim
FROM ${DEBIAN_BASE} AS python
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
