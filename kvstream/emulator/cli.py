"""``kvstream emulate``: one emulated vLLM engine, of one or several DP ranks (docs/EMULATOR.md)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click
from aiohttp import web

from kvstream.emulator.options import EmulatorOptions, KvEventsOptions
from kvstream.engine_model.costs import CostModel
from kvstream.engine_model.errors import EngineModelError
from kvstream.logs import get_logger
from kvstream.roles import Handoff, Role

_log = get_logger(__name__)
_E = EmulatorOptions()
_C = CostModel()


@click.command("emulate")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP API listens on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="HTTP port (vLLM's).")
@click.option("--model", default=_E.model, show_default=True, help="Served model name (`model` of requests).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=_E.max_model_len, show_default=True,
              help="Longest prompt + output, in tokens.")
@click.option("--block-size", type=click.IntRange(min=1), default=_E.block_size, show_default=True,
              help="Tokens per KV block (vLLM's --block-size).")
@click.option("--num-gpu-blocks", type=click.IntRange(min=1), default=_E.num_gpu_blocks, show_default=True,
              help="G1 capacity in blocks (vLLM's --num-gpu-blocks-override); 16,384 × 16 tokens is 32 GiB of "
                   "Llama-3-8B KV.")
@click.option("--num-cpu-blocks", type=click.IntRange(min=0), default=_E.num_cpu_blocks, show_default=True,
              help="Host (CPU) tier behind G1, in blocks, as vLLM's KV offloading to CPU (its "
                   "--kv-offloading-size in GiB ÷ 2 MiB per Llama-3-8B block of 16); 0: none.")
@click.option("--onboard-host-ms-per-token", type=float, default=_C.onboard_host_ms_per_token, show_default=True,
              help="cost: loading a token's KV from the host tier (128 KiB over ~25 GB/s PCIe).")
@click.option("--kv-transfer-ms-per-token", type=float, default=_C.kv_transfer_ms_per_token, show_default=True,
              help="cost: a decode engine receiving a prompt token's KV from the prefill engine (128 KiB over "
                   "~50 GB/s RDMA).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=_C.batch_limit, show_default=True,
              help="Requests running at once (the cost model's batch limit).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=2), default=_C.max_batch_tokens,
              show_default=True, help="Token budget of a step (chunked prefill).")
@click.option("--prefill-ms-per-token", type=float, default=_C.prefill_ms_per_token, show_default=True,
              help="cost: prefill compute per prompt token not in the cache (docs/RESULTS.md).")
@click.option("--decode-ms-per-token", type=float, default=_C.decode_ms_per_token, show_default=True,
              help="cost: decode compute per running request per step.")
@click.option("--decode-ms-per-context-token", type=float, default=_C.decode_ms_per_context_token,
              show_default=True, help="cost: KV reads per context token of the decoding requests per step.")
@click.option("--min-step-ms", type=float, default=_C.min_step_ms, show_default=True,
              help="cost: the shortest step (the weights are read once per step).")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="Run this many times faster than the cost model's real time.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A local HF tokenizer.json (default: the documented word-hash fallback).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A Jinja chat template file (default: '<|role|>' lines).")
@click.option("--kv-events-endpoint",
              help="Publish vLLM KV events on this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (bound; "
                   "port + DP rank).")
@click.option("--kv-events-replay-endpoint", help="The replay ROUTER address (bound; port + DP rank).")
@click.option("--kv-events-topic", default="", show_default=True, help="Topic frame of every KV-event message.")
@click.option("--kv-events-buffer-steps", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Past batches kept for replay.")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="DP ranks behind the one HTTP server, each its own scheduler, KV cache and KV events (rank r "
                   "on the KV-event ports + r); X-data-parallel-rank picks one, else the least loaded.")
@click.option("--data-parallel-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="The rank of a one-rank engine: stamped on every batch, its metrics' engine label, added to "
                   "the KV-event ports (not with --data-parallel-size).")
@click.option("--role", type=click.Choice([r.value for r in Role]), default="both", show_default=True,
              help="A whole engine, or one side of a disaggregated prefill/decode pair (docs/EMULATOR.md).")
@click.option("--handoff", type=click.Choice([h.value for h in Handoff]),
              help="How the prefill side hands the KV to the decode side: vLLM's NixlConnector "
                   "(kv_transfer_params) or SGLang's bootstrap server (bootstrap_host/port/room). Required for "
                   "role prefill or decode.")
@click.option("--bootstrap-port", type=click.IntRange(1, 65535),
              help="The bootstrap server's port (role prefill with --handoff bootstrap only).")
def emulate(host: str, port: int, model: str, max_model_len: int, block_size: int, num_gpu_blocks: int,
            num_cpu_blocks: int, onboard_host_ms_per_token: float, kv_transfer_ms_per_token: float,
            max_num_seqs: int, max_num_batched_tokens: int, prefill_ms_per_token: float, decode_ms_per_token: float,
            decode_ms_per_context_token: float, min_step_ms: float, speed: float, tokenizer: Path | None,
            chat_template: Path | None, kv_events_endpoint: str | None, kv_events_replay_endpoint: str | None,
            kv_events_topic: str, kv_events_buffer_steps: int, data_parallel_size: int, data_parallel_rank: int,
            role: str, handoff: str | None, bootstrap_port: int | None) -> None:
    """An emulated vLLM engine: vLLM's OpenAI API, scheduling and KV events, with the time of
    kvstream simulate's cost model and placeholder output tokens."""
    try:
        if kv_events_replay_endpoint and not kv_events_endpoint:
            raise click.UsageError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        events = KvEventsOptions(kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic,
                                 kv_events_buffer_steps) if kv_events_endpoint else None
        cost = CostModel(prefill_ms_per_token=prefill_ms_per_token, decode_ms_per_token=decode_ms_per_token,
                         decode_ms_per_context_token=decode_ms_per_context_token, min_step_ms=min_step_ms,
                         onboard_host_ms_per_token=onboard_host_ms_per_token,
                         kv_transfer_ms_per_token=kv_transfer_ms_per_token,
                         batch_limit=max_num_seqs, max_batch_tokens=max_num_batched_tokens)
        options = EmulatorOptions(
            model=model, max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks, cost=cost, speed=speed, tokenizer=tokenizer, chat_template=chat_template,
            kv_events=events, data_parallel_size=data_parallel_size, data_parallel_rank=data_parallel_rank,
            role=role, handoff=handoff, bootstrap_port=bootstrap_port)
        asyncio.run(_serve(options, host, port))
    except EngineModelError as exc:
        raise click.ClickException(str(exc)) from None


async def _serve(options: EmulatorOptions, host: str, port: int) -> None:
    from kvstream.emulator.server import make_app

    app = make_app(options, host, port)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ev = options.kv_events
        _log.info("emulate.ready", url=f"http://{host}:{port}", model=options.model, speed=options.speed,
                  ranks=f"{options.ranks.start}-{options.ranks.stop - 1}", role=options.role, handoff=options.handoff, bootstrap_port=options.bootstrap_port,
                  kv_events=ev.endpoint if ev else None, replay=ev.replay_endpoint if ev else None)
        await stop.wait()
    finally:
        await runner.cleanup()
