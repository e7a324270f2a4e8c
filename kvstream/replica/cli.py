"""A replica's settings as the options of its parts (the router's config, the replica's
options, the tokens by scope, the HTTP limits), the bind rule and the HTTP server: what
``kvstream router`` (kvstream.serve) builds a replica with, and the tools and benchmarks
that build one as it does."""

from __future__ import annotations

import gc
import ipaddress
from dataclasses import fields, replace

import click
import uvicorn

from kvstream.replica.auth import Tokens, read_token
from kvstream.replica.http_limits import fit_connections, guarded_protocol
from kvstream.replica.options import HttpLimits, ReplicaOptions
from kvstream.router import RouterConfig, SchedulerConfig
from kvstream.settings import Settings

#: The field of SchedulerConfig that a route request may set but [router] has no key for.
PER_REQUEST_ONLY = frozenset({"allowed_workers"})


def router_config(settings: Settings) -> RouterConfig:
    """[router] as the router's config: every field of RouterConfig and (but the
    per-request one) of its SchedulerConfig is a key there (a missing one fails here;
    tests/settings pin the sets)."""
    r = settings.router
    scheduler = SchedulerConfig(
        **{f.name: getattr(r, f.name) for f in fields(SchedulerConfig) if f.name not in PER_REQUEST_ONLY}
    )
    own = {f.name: getattr(r, f.name) for f in fields(RouterConfig) if f.name != "scheduler"}
    return RouterConfig(scheduler=scheduler, **own)


def tokens(settings: Settings) -> Tokens:
    """The tokens of each scope, from values (env, TOML) or files; TokenError if one is
    empty or unreadable."""
    r = settings.replica
    return Tokens.build(
        read_token(r.token, r.token_file, "token"),
        read_token(r.client_token, r.client_token_file, "client_token"),
        read_token(r.operator_token, r.operator_token_file, "operator_token"),
        read_token(r.peer_token, r.peer_token_file, "peer_token"),
    )


def replica_options(settings: Settings) -> ReplicaOptions:
    rs = settings.replica
    # Replicas of one deployment share their tokens, so the peer accepts this one's.
    peer_token = read_token(rs.peer_token, rs.peer_token_file, "peer_token") or read_token(
        rs.token, rs.token_file, "token"
    )
    return rs.to_options(ReplicaOptions, peer_token=peer_token)


def http_limits(settings: Settings) -> HttpLimits:
    return settings.replica.to_options(HttpLimits)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def freeze_heap() -> None:
    """Exempt every object alive now (modules, settings, the recovered state: they live as
    long as the process) from the cyclic collector's full passes, which walk them all and
    would stall the event loop for tens of milliseconds at a time (the p99 of routing)."""
    gc.freeze()


def server_config(app: object, settings: Settings, limits: HttpLimits, on_reject) -> uvicorn.Config:
    """uvicorn with the HTTP limits (kvstream.replica.http_limits) and TLS when set."""
    r = settings.replica
    if (r.tls_certfile is None) != (r.tls_keyfile is None):
        raise click.ClickException("TLS needs both tls_certfile and tls_keyfile")
    limits = replace(limits, max_connections=fit_connections(limits.max_connections, limits.probe_connections))
    return uvicorn.Config(
        app, host=r.host, port=r.port, log_level="warning",
        # No access log: a line per request would cost more than a routing decision.
        access_log=False,
        http=guarded_protocol(limits, on_reject),
        # A second fence behind the protocol's own cap (which evicts before refusing).
        limit_concurrency=limits.max_connections + limits.probe_connections + 1,
        timeout_keep_alive=5,
        ssl_certfile=str(r.tls_certfile) if r.tls_certfile else None,
        ssl_keyfile=str(r.tls_keyfile) if r.tls_keyfile else None,
    )
