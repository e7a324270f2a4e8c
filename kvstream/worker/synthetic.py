"""The synthetic engine: drives the tiered pool like an inference engine, with no model.

For each prompt it onboards the cached prefix (G1, then G2, then G3), allocates G1 blocks
for the rest, fills them with bytes derived from the block's sequence hash (so that any
copy can be checked anywhere, any time), registers them, and releases the whole prompt
when the "request" ends. Together with the pool's sink, this runs the whole worker side.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kvstream.events.model import Tier
from kvstream.hashing import block_hashes
from kvstream.worker.errors import LayoutError, PoolConfigError, PoolExhaustedError
from kvstream.worker.layout import BlockLayout
from kvstream.worker.lifecycle import PoolRequest
from kvstream.worker.offload import OffloadEngine, OffloadOptions
from kvstream.worker.onboard import Onboarder
from kvstream.worker.pool import PoolOptions, TieredBlockPool
from kvstream.worker.source_events import SourceEventSink

_SEED_MASK = (1 << 63) - 1


def block_content(layout: BlockLayout, block_hash: int) -> torch.Tensor:
    """The deterministic content of block ``block_hash`` (on the CPU): pseudo-random bytes
    seeded by the hash."""
    gen = torch.Generator()
    gen.manual_seed(block_hash & _SEED_MASK)
    raw = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=gen)
    return raw.view(layout.dtype).view(layout.block_shape)


@dataclass(frozen=True, slots=True)
class PromptSetOptions:
    """Prompts that share prefixes: each takes the first 1..``prefix_blocks`` blocks of one
    of ``prefixes`` shared prefixes, then ``suffix_blocks`` blocks of its own."""

    prompts: int = 100
    prefixes: int = 8
    prefix_blocks: int = 8
    suffix_blocks: int = 2
    block_size: int = 16
    vocab: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.prefixes, self.prefix_blocks, self.block_size, self.vocab) <= 0 or self.suffix_blocks < 0:
            raise PoolConfigError(f"prompt set options must be positive: {self}")


def shared_prefix_prompts(options: PromptSetOptions) -> Iterator[list[int]]:
    """A seeded stream of token-id prompts with shared prefixes."""
    rng = random.Random(options.seed)
    bs = options.block_size
    prefixes = [
        [rng.randrange(options.vocab) for _ in range(options.prefix_blocks * bs)]
        for _ in range(options.prefixes)
    ]
    for _ in range(options.prompts):
        prefix = rng.choice(prefixes)[: rng.randint(1, options.prefix_blocks) * bs]
        yield prefix + [rng.randrange(options.vocab) for _ in range(options.suffix_blocks * bs)]


@dataclass(frozen=True, slots=True)
class PromptResult:
    blocks: int
    device_hits: int
    host_hits: int
    disk_hits: int
    computed: int


@dataclass(slots=True)
class SyntheticStats:
    prompts: int = 0
    blocks: int = 0
    device_hits: int = 0
    host_hits: int = 0
    disk_hits: int = 0
    computed: int = 0

    def add(self, r: PromptResult) -> None:
        self.prompts += 1
        self.blocks += r.blocks
        self.device_hits += r.device_hits
        self.host_hits += r.host_hits
        self.disk_hits += r.disk_hits
        self.computed += r.computed


class SyntheticEngine:
    """Runs prompts against a pool. ``verify`` checks every onboarded block's bytes
    against its expected content (raises LayoutError on a mismatch)."""

    def __init__(
        self,
        pool: TieredBlockPool,
        offload: OffloadEngine | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        verify: bool = False,
    ) -> None:
        self.pool = pool
        self.offload = offload
        self.lora_name = lora_name
        self.priority = priority
        self.verify = verify
        self.onboarder = Onboarder(pool)
        self.stats = SyntheticStats()

    def run_prompt(self, tokens: Iterable[int]) -> PromptResult:
        pool = self.pool
        layout = pool.layout
        local, seq = block_hashes(list(tokens), layout.block_size, self.lora_name)
        req = PoolRequest(self.onboarder, local, seq, self.priority)
        found = req.found
        try:
            if self.verify:
                self._check(found.block_hashes[found.device_blocks :])
            slots = req.allocate(self._allocate)
            try:
                for slot, i in req.computed():
                    # Generated on the CPU so that the content of a hash is the same on any device.
                    pool.write_block(slot, block_content(layout, seq[i]))
            except BaseException:
                pool.device.free(slots)
                raise
            req.prefilled()
        except BaseException:
            req.abort()
            raise
        # The request ran; it ends now and releases its blocks (they stay cached).
        req.release()
        result = PromptResult(len(seq), found.device_blocks, found.host_blocks, found.disk_blocks, len(slots))
        self.stats.add(result)
        return result

    def run(self, prompts: Iterable[Iterable[int]]) -> SyntheticStats:
        for tokens in prompts:
            self.run_prompt(tokens)
        return self.stats

    def _allocate(self, n: int) -> list[int]:
        try:
            return self.pool.device.allocate(n)
        except PoolExhaustedError:
            if self.offload is None:
                raise
            # Blocks pinned for offload come free once their copies complete.
            self.offload.wait_idle()
            return self.pool.device.allocate(n)

    def _check(self, hashes: Iterable[int]) -> None:
        pool = self.pool
        for h in hashes:
            expected = block_content(pool.layout, h).view(torch.uint8).numpy().tobytes()
            if pool.read_block(Tier.DEVICE, h) != expected:
                raise LayoutError(f"onboarded block {h:#018x} differs from its content")


@dataclass(frozen=True, slots=True)
class SyntheticWorkerOptions:
    layout: BlockLayout
    device_capacity: int | str
    pool: PoolOptions
    offload: OffloadOptions = OffloadOptions()
    #: None: cuda where present, else cpu.
    device: str | None = None
    lora_name: str | None = None
    verify: bool = False


class SyntheticWorker:
    """A pool, its offload engine and a synthetic engine, reporting to ``sink``."""

    def __init__(self, options: SyntheticWorkerOptions, sink: SourceEventSink) -> None:
        self.pool = TieredBlockPool.create(options.layout, options.device_capacity, options.pool, sink, options.device)
        try:
            self.offload = OffloadEngine(self.pool, options.offload)
        except BaseException:
            self.pool.close()
            raise
        self.engine = SyntheticEngine(self.pool, self.offload, options.lora_name, verify=options.verify)

    def run(self, prompts: Iterable[Iterable[int]]) -> SyntheticStats:
        return self.engine.run(prompts)

    def close(self, drain: bool = True) -> None:
        try:
            self.offload.close(drain=drain)
        finally:
            self.pool.close()

    def __enter__(self) -> SyntheticWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
