"""The trace replayers of ``kvstream bench fleet``: what sends a trace slice to a router
(or, in turn, to several base URLs) at the requests' due times and reports what it saw.

- ``aiperf`` (NVIDIA's, PyPI, pinned): the third-party one, installed on first use into
  ``$KVSTREAM_BENCH_VENVS`` or ``~/.cache/kvstream/bench-venvs/aiperf-<version>-py<X.Y>/``
  (bench.venvs). The slice is written as a Mooncake trace (timestamps already divided by
  the speed, lengths scaled, the hash ids as they are) and replayed by ``aiperf profile
  --custom-dataset-type mooncake_trace`` on its fixed schedule, streaming
  ``/v1/completions``. aiperf makes each prompt from its hash ids, one block of
  ``Scale.tokens_per_id`` tokens per id (``--isl-block-size``), so equal ids give equal
  text, measured in tokens of the engines' own tokenizer.json: aiperf loads tokenizers
  only by Hugging Face repo name when offline (a local path fails in its decoding worker
  processes, which run with ``HF_HUB_OFFLINE``), so the file is laid out as a one-file
  repository in an HF cache of its own beside the venv. The figures are aiperf's own
  (its ``profile_export_aiperf.json``), with its scheduling lag: how late the requests
  left against their due times, i.e. whether the load generator kept up.
- ``sdk``: kvstream's own (kvstream.tools.fleet.replay: the ``openai`` SDK, asyncio).

Either one's cached-token share is the engines' own count, summed from every successful
response's ``usage.prompt_tokens_details.cached_tokens`` over its ``prompt_tokens``. Each
also gives every request's own outcome (aiperf's from its ``profile_export.jsonl``), in
the slice's order, for figures over a part of the run (before and after a router restart).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import click

from bench.venvs import cached_venv
from kvstream.tools import fleet
from kvstream.tools.procs import ManagedProcess, free_port
from kvstream.tools.simulate.trace import Request

AIPERF_VERSION = "0.13.0"
#: The name aiperf is given for the engines' tokenizer.json (a repository of the HF cache
#: laid out beside its venv; nothing is fetched).
_TOKENIZER_REPO = "kvstream/fleet-tokenizer"
#: aiperf's own start (its services, the dataset) before the first request leaves, and
#: its exit after the last one ends: what the wait for it allows on top of the replay.
_AIPERF_OVERHEAD_S = 180.0


class Replayer(Protocol):
    """Sends ``requests`` to ``targets`` (base URLs, no ``/v1``; request ``i`` to
    ``targets[i % len(targets)]``) at their due times; every failure is counted."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def replay(self, requests: Sequence[Request], scale: fleet.Scale, targets: Sequence[str],
               work: Path) -> tuple[fleet.Summary, dict[str, Any], list[fleet.Outcome]]:
        """The summary, what else the replayer reports about its own timing, and each
        request's outcome (in the order of ``requests``)."""
        ...


@dataclass(frozen=True, slots=True)
class SdkReplayer:
    """kvstream.tools.fleet's replayer; ``text``: prompts as words, not token ids."""

    text: bool = True
    timeout_s: float = 60.0

    @property
    def name(self) -> str:
        return "sdk"

    @property
    def version(self) -> str:
        import openai

        return f"kvstream.tools.fleet (openai {openai.__version__}, asyncio)"

    def replay(self, requests: Sequence[Request], scale: fleet.Scale, targets: Sequence[str],
               work: Path) -> tuple[fleet.Summary, dict[str, Any], list[fleet.Outcome]]:
        outcomes, seconds = fleet.replay_outcomes(
            requests, scale, lambda i: targets[i % len(targets)], timeout=self.timeout_s, text=self.text
        )
        return fleet.summarize(outcomes, seconds), {"prompts": "text" if self.text else "token ids"}, outcomes


def venvs_root() -> Path:
    return Path(os.environ.get("KVSTREAM_BENCH_VENVS", Path.home() / ".cache" / "kvstream" / "bench-venvs"))


def aiperf_venv_dir() -> Path:
    return venvs_root() / f"aiperf-{AIPERF_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"


def aiperf_venv() -> Path:
    """aiperf's virtual environment, created and filled on first use (about a minute)."""
    return cached_venv("the trace replayer", aiperf_venv_dir(), (f"aiperf=={AIPERF_VERSION}",))


def tokenizer_hub(tokenizer: Path, venv: Path) -> Path:
    """An HF hub cache holding ``tokenizer`` as the one-file repository
    ``_TOKENIZER_REPO`` (its revision: the file's SHA-1), for aiperf's offline loader."""
    hub = venv / "hf-hub"
    data = tokenizer.read_bytes()
    revision = hashlib.sha1(data).hexdigest()
    repo = hub / ("models--" + _TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if not (snapshot / "tokenizer.json").is_file():
        part = snapshot.with_name(revision + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        (part / "tokenizer.json").write_bytes(data)
        # Without it transformers cannot tell which tokenizer class a bare file is.
        (part / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        shutil.rmtree(snapshot, ignore_errors=True)
        part.rename(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return hub


def write_trace(requests: Sequence[Request], scale: fleet.Scale, path: Path) -> None:
    """The slice as a Mooncake trace, scaled: timestamps (ms) from the first request's,
    input and output lengths as ``scale`` makes them, hash ids unchanged."""
    first = requests[0].arrival_ms if requests else 0.0
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": round(r.arrival_ms - first, 3), "input_length": scale.input_tokens(r),
                                "output_length": scale.max_tokens(r), "hash_ids": list(r.hash_ids)}) + "\n")


@dataclass(frozen=True, slots=True)
class AiperfReplayer:
    """``aiperf profile`` on the slice's Mooncake trace, on its fixed schedule."""

    timeout_s: float = 60.0

    @property
    def name(self) -> str:
        return "aiperf"

    @property
    def version(self) -> str:
        return AIPERF_VERSION

    def command(self, venv: Path, trace: Path, targets: Sequence[str], scale: fleet.Scale, out: Path) -> list[str]:
        return [
            str(venv / "bin" / "aiperf"), "profile", "--model-names", fleet.MODEL,
            *[a for t in targets for a in ("--url", t)], "--endpoint-type", "completions", "--streaming",
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--isl-block-size", str(scale.tokens_per_id), "--tokenizer", _TOKENIZER_REPO,
            # The engines' usage (what they counted), not aiperf's re-tokenization.
            "--use-server-token-count", "--request-timeout-seconds", f"{self.timeout_s:g}", "--random-seed", "0",
            "--output-artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        ]

    def replay(self, requests: Sequence[Request], scale: fleet.Scale, targets: Sequence[str],
               work: Path) -> tuple[fleet.Summary, dict[str, Any], list[fleet.Outcome]]:
        if scale.tokenizer is None:
            raise click.ClickException("the aiperf replayer needs the engines' tokenizer.json (Scale.tokenizer)")
        if not requests:
            raise click.ClickException("the aiperf replayer got no requests")
        venv = aiperf_venv()
        work.mkdir(parents=True, exist_ok=True)
        trace, out = work / "trace.jsonl", work / "aiperf"
        write_trace(requests, scale, trace)
        env = {"HF_HUB_CACHE": str(tokenizer_hub(scale.tokenizer, venv)), "HF_HUB_OFFLINE": "1",
               "NO_COLOR": "1", "COLUMNS": "160"}
        span_s = (requests[-1].arrival_ms - requests[0].arrival_ms) / 1000
        # aiperf listens on no port of ours (its services talk over IPC): the port is a placeholder.
        proc = ManagedProcess.start("aiperf", self.command(venv, trace, targets, scale, out), free_port(), env=env)
        try:
            wait_s = span_s + self.timeout_s + _AIPERF_OVERHEAD_S
            deadline = time.monotonic() + wait_s
            while proc.popen.poll() is None:
                if time.monotonic() > deadline:
                    raise click.ClickException(f"aiperf did not finish within {wait_s:.0f}s:\n{proc.log_tail()}")
                time.sleep(0.2)
            if proc.popen.returncode != 0:
                raise click.ClickException(f"aiperf exited with code {proc.popen.returncode}:\n{proc.log_tail(4000)}")
            export = out / "profile_export_aiperf.json"
            if not export.is_file():
                raise click.ClickException(f"aiperf wrote no {export.name}:\n{proc.log_tail(4000)}")
            summary, extra = summarize_export(json.loads(export.read_text()), len(requests))
            return summary, extra, read_records(out / "profile_export.jsonl", len(requests))
        finally:
            proc.stop()


def read_records(path: Path, sent: int) -> list[fleet.Outcome]:
    """aiperf's per-request records as outcomes, by the trace line each replayed (its
    fixed schedule makes line ``i`` session ``i``); a request with no record failed."""
    out = [fleet.Outcome(False, error="no record from aiperf") for _ in range(sent)]
    if not path.is_file():
        return out
    with path.open() as f:
        for line in f:
            rec = json.loads(line)
            i = rec.get("metadata", {}).get("session_num")
            if not isinstance(i, int) or not 0 <= i < sent:
                continue
            error = rec.get("error")
            if error:
                out[i] = fleet.Outcome(False, error=f"{error.get('type')}: {str(error.get('message'))[:120]}")
                continue
            m = rec.get("metrics", {})

            def value(key: str) -> float:
                v = m.get(key, {}).get("value")
                return math.nan if v is None else float(v)

            out[i] = fleet.Outcome(
                True, value("time_to_first_token"), value("request_latency"),
                int(value("usage_prompt_tokens")) if not math.isnan(value("usage_prompt_tokens")) else 0,
                int(value("usage_prompt_cache_read_tokens")) if not math.isnan(value("usage_prompt_cache_read_tokens")) else 0,
            )
    return out


def summarize_export(export: dict[str, Any], sent: int) -> tuple[fleet.Summary, dict[str, Any]]:
    """aiperf's summary as the bench's: its percentiles, throughput and error counts, the
    engines' usage summed; requests aiperf never completed count as failed."""

    def stat(key: str, field: str = "avg") -> float:
        value = export.get(key, {}).get(field)
        return math.nan if value is None else float(value)

    ok = int(stat("request_count")) if not math.isnan(stat("request_count")) else 0
    errors = [f"{e['error_details'].get('type')}: {str(e['error_details'].get('message'))[:120]} (x{e['count']})"
              for e in export.get("error_summary") or []]
    completed = stat("completed_request_count")
    if not math.isnan(completed) and int(completed) < sent:
        errors.append(f"aiperf completed {int(completed)} of the {sent} requests")
    prompt = stat("total_usage_prompt_tokens")
    cached = stat("total_usage_prompt_cache_read_tokens")
    summary = fleet.Summary(
        sent, sent - ok, stat("time_to_first_token", "p50"), stat("time_to_first_token", "p90"),
        stat("time_to_first_token", "p99"), stat("request_latency", "p50"), stat("request_latency", "p99"),
        0.0 if math.isnan(stat("request_throughput")) else stat("request_throughput"),
        cached / prompt if prompt and not math.isnan(prompt) and not math.isnan(cached) else 0.0,
        stat("benchmark_duration"), tuple(errors[:5]),
    )
    lag = {f"replay_sched_lag_{q}_ms": None if math.isnan(v := stat(f"replay_sched_lag_{q}")) else round(v, 2)
           for q in ("p50", "p99")}
    return summary, {"prompts": "aiperf text from hash ids", **lag}


REPLAYERS: dict[str, type[SdkReplayer | AiperfReplayer]] = {"aiperf": AiperfReplayer, "sdk": SdkReplayer}
