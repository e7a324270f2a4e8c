"""A router replica with its gateway, served by the replica's own HTTP server (uvicorn
with kvstream's protocol) on a loopback port, in front of test backends; and the test
tokenizer: DeepSeek's tokenizer.json as shipped inside the litellm wheel (MIT), read with
HF ``tokenizers``."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import uvicorn
from tokenizers import Tokenizer

from kvstream.events.model import Stored, Tier
from kvstream.gateway.app import Gateway
from kvstream.gateway.options import GatewayOptions, StaticWorker
from kvstream.gateway.static import StaticDirectory
from kvstream.tools.tokenizer_file import deepseek_tokenizer
from kvstream.hashing import block_hashes
from kvstream.replica.cli import server_config
from kvstream.replica.http_limits import HttpLimits
from kvstream.replica.replica import Replica
from kvstream.replica.service import create_app
from kvstream.router.index import WorkerKey
from kvstream.settings import ReplicaSettings, Settings
from tests.gateway.backends import Backend
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce

TOKEN = "s3cret"
MODEL = "m"
LORA = "m-lora"
_worker_ids = itertools.count(100)  # new ids for every gateway: nothing carries over


def tokenizer_file() -> Path:
    """The DeepSeek tokenizer.json from the litellm wheel (kvstream.tools.tokenizer_file)."""
    return deepseek_tokenizer()


class HFPromptTokenizer:
    """A PromptTokenizer over HF ``tokenizers`` for the tests (chat messages rendered by a
    plain role/content template: the real chat templates are kvstream.gateway.tokenize's)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in body["messages"])
        return self.tokenizer.encode(text + "<|assistant|>").ids


@dataclass
class Served:
    port: int
    gateway: Gateway
    #: worker id of each backend, in the order given.
    ids: list[int]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=TOKEN, max_retries=0, timeout=30, **kw)


@contextmanager
def serving(replica: Replica, backends: Sequence[Backend | str], tokenizers: Mapping[str, Any] | None = None,
            api_keys: Mapping[int, str] | None = None, roles: Sequence[Mapping[str, Any]] | None = None,
            **options: Any) -> Iterator[Served]:
    """A gateway over ``backends`` (a Backend, or a URL), each a new worker id serving
    ``m`` and the LoRA ``m-lora`` (with the StaticWorker fields of ``roles``, one mapping
    per backend, when given); ``options`` are GatewayOptions (health probes off unless
    asked for)."""
    ids = [next(_worker_ids) for _ in backends]
    workers = tuple(
        StaticWorker(wid, b.url if isinstance(b, Backend) else b, (MODEL,), (LORA,), (api_keys or {}).get(i),
                     **(roles[i] if roles else {}))
        for i, (wid, b) in enumerate(zip(ids, backends))
    )
    options.setdefault("health_interval_s", 0.0)
    opts = GatewayOptions(workers=workers, **options)
    gateway = Gateway(replica, StaticDirectory(workers), opts, tokenizers)
    app = create_app(replica, token=TOKEN, gateway=gateway)
    settings = Settings(replica=ReplicaSettings(port=0))
    server = uvicorn.Server(server_config(app, settings, HttpLimits(), lambda _: None))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        assert t.is_alive(), "the replica's server did not start"
        time.sleep(0.02)
    try:
        yield Served(server.servers[0].sockets[0].getsockname()[1], gateway, ids)
    finally:
        server.should_exit = True
        t.join(10)


def publish_prefix(replica: Replica, worker_id: int, token_ids: list[int], lora: str | None = None, rank: int = 0,
                   also: Sequence[list[int]] = ()) -> None:
    """The worker stores the prompt's full blocks (hashed as kvstream.hashing hashes the
    token ids, with the LoRA adapter's name if any), and those of the prompts ``also``,
    through the real broker (a new incarnation: nothing else), and the replica has
    folded them."""
    w = FakeWorkerLog(worker_id, ranks=rank + 1)
    cleared = w.cleared(rank)
    events, held = [cleared], set()
    for prompt in (token_ids, *also):
        local, seq = block_hashes(prompt, lora_name=lora)
        events.append(Stored(worker_id, rank, Tier.DEVICE, w.epoch, cleared.event_id + len(events), None, tuple(seq), tuple(local)))
        held.update(seq)
    blocks = len(held)
    produce(replica.settings, [(worker_id, w.batch(*events))])

    def folded() -> bool:
        ranks = replica.workers_view()["workers"].get(str(worker_id), {}).get("ranks", {})
        return sum(ranks.get(str(rank), {}).values()) >= blocks

    wait_until(folded, "the replica never folded the worker's blocks")


def load_of(replica: Replica, worker_id: int) -> int:
    """Active requests the replica counts on the worker."""
    with replica.lock:
        load = replica.router.load(WorkerKey(worker_id, 0))
    return 0 if load is None else load.requests


def wait_until(check: Callable[[], bool], why: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)
