"""``kvstream hash``: print a prompt's block hashes as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvstream.hashing import DEFAULT_BLOCK_SIZE, MmSpan, block_hashes


def _mm_span(text: str) -> MmSpan:
    try:
        h, offset, length = (int(part, 0) for part in text.split(":"))
        return MmSpan(h, offset, length)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: expected HASH:OFFSET:LENGTH ({exc})", param_hint="--mm") from None


@click.command("hash")
@click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True)
@click.option("--lora", "lora_name", default=None, help="LoRA adapter name (changes local hashes).")
@click.option("--salt", "cache_salt", default=None, help="Cache salt / namespace (changes local hashes).")
@click.option(
    "--mm",
    "mm",
    multiple=True,
    help="A multimodal object as HASH:OFFSET:LENGTH (u64 hash, prompt positions); repeatable.",
)
@click.option(
    "--tokens-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File holding one JSON array of token ids.",
)
@click.argument("tokens", nargs=-1, type=int)
def hash_cmd(
    block_size: int,
    lora_name: str | None,
    cache_salt: str | None,
    mm: tuple[str, ...],
    tokens_file: Path | None,
    tokens: tuple[int, ...],
) -> None:
    """Print {"block_size", "local", "sequence"} for TOKEN... (u32 token ids).

    Hashes equal NVIDIA Dynamo's compute_block_hash_for_seq with the same LoRA name,
    cache namespace (--salt) and multimodal objects (DESIGN.md §1)."""
    if tokens_file is not None and tokens:
        raise click.UsageError("give tokens either as arguments or with --tokens-file, not both")
    if tokens_file is not None:
        try:
            ids = json.loads(tokens_file.read_text())
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--tokens-file") from None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise click.BadParameter("must hold one JSON array of integers", param_hint="--tokens-file")
    else:
        ids = list(tokens)
    spans = [_mm_span(m) for m in mm]
    try:
        local, sequence = block_hashes(ids, block_size, lora_name, cache_salt=cache_salt, mm=spans)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="TOKEN") from None
    click.echo(json.dumps({"block_size": block_size, "local": local, "sequence": sequence}))
