"""`tiered-kv` command line: `demo` (the main job), `bench NAME`, `serve` and `inspect DIR`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

from tiered_kv.benchmarks.progress import Progress
from tiered_kv.config import EngineConfig, format_size
from tiered_kv.engine import TieredKVEngine
from tiered_kv.errors import EngineStateError
from tiered_kv.gpu.base import MoverStats
from tiered_kv.keys import ChunkKey
from tiered_kv.metrics import EngineStats
from tiered_kv.storage import StorageStats, TierReadStats, WriteQueueStats
from tiered_kv.sync import new_event_loop
from tiered_kv.tiers.l1 import L1Stats


# -- demo ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DemoModel:
    num_layers: int = 4
    num_kv_heads: int = 4
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 512
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass
class DemoReport:
    turns: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    verified_chunks: int = 0
    mismatched_chunks: int = 0
    restart_hit_tokens: int = 0
    restart_prompt_tokens: int = 0
    short_retrieves: int = 0  # lookup promised more than L1 could hold at retrieve time


class SimulatedModel:
    """Paged KV caches (vLLM NHD) whose 'prefill' writes content derived from each chunk's key,
    so that any retrieved chunk can be checked bit for bit."""

    def __init__(self, spec: DemoModel, device: torch.device, chunk_size: int) -> None:
        self.spec = spec
        self.chunk_size = chunk_size
        shape = (2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        self.caches = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.free_blocks = list(range(spec.num_blocks))
        # What the engine knows about its own caches; a shape alone has two readings.
        self.layout_hints = {"block_size": spec.block_size, "kv_layout": "NHD"}

    def allocate_blocks(self, num_tokens: int, rng: random.Random) -> list[int]:
        needed = -(-num_tokens // self.spec.block_size)
        if needed > len(self.free_blocks):
            raise RuntimeError("demo: out of GPU blocks; raise DemoModel.num_blocks")
        rng.shuffle(self.free_blocks)
        blocks, self.free_blocks = self.free_blocks[:needed], self.free_blocks[needed:]
        return blocks

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    def chunk_content(self, key: ChunkKey, num_tokens: int) -> torch.Tensor:
        """uint8 ``[layers, 2, T, heads*head_size*itemsize]``, determined by the chunk key."""
        s = self.spec
        gen = torch.Generator().manual_seed(int.from_bytes(key.chunk_hash[:8], "little"))
        row = s.num_kv_heads * s.head_size * s.dtype.itemsize
        return torch.randint(
            0, 256, (s.num_layers, 2, num_tokens, row), dtype=torch.uint8, generator=gen
        )

    def _slots(self, blocks: list[int], start: int, count: int) -> tuple[torch.Tensor, ...]:
        device = self.caches[0].device
        positions = torch.arange(start, start + count)
        block_ids = torch.tensor(blocks, dtype=torch.long)[positions // self.spec.block_size]
        return block_ids.to(device), (positions % self.spec.block_size).to(device)

    def prefill(self, keys: Sequence[ChunkKey], blocks: list[int], start: int, total: int) -> None:
        """Write the KV of tokens [start, total) (what the model would compute)."""
        for index, key in enumerate(keys):
            lo, hi = index * self.chunk_size, min((index + 1) * self.chunk_size, total)
            if hi <= start:
                continue
            content = self.chunk_content(key, hi - lo)[:, :, max(start, lo) - lo :]
            block_ids, offsets = self._slots(blocks, max(start, lo), content.shape[2])
            for layer, cache in enumerate(self.caches):
                rows = content[layer].to(cache.device)
                view = cache.view(torch.uint8).view(2, *cache.shape[1:4], -1)
                view[:, block_ids, offsets] = rows.view(
                    2, rows.shape[1], self.spec.num_kv_heads, -1
                )

    def verify(self, keys: Sequence[ChunkKey], blocks: list[int], valid: int) -> tuple[int, int]:
        """(good, bad) chunks among those wholly or partly inside [0, valid)."""
        good = bad = 0
        for index, key in enumerate(keys):
            lo = index * self.chunk_size
            if lo >= valid:
                break
            hi = min(lo + self.chunk_size, valid)
            content = self.chunk_content(key, min(self.chunk_size, hi - lo))
            block_ids, offsets = self._slots(blocks, lo, hi - lo)
            ok = True
            for layer, cache in enumerate(self.caches):
                view = cache.view(torch.uint8).view(2, *cache.shape[1:4], -1)
                got = view[:, block_ids, offsets].reshape(2, hi - lo, -1).cpu()
                ok &= torch.equal(got, content[layer, :, : hi - lo])
            good, bad = (good + 1, bad) if ok else (good, bad + 1)
        return good, bad


@dataclasses.dataclass
class Conversation:
    history: list[int]


def _demo_config(args: argparse.Namespace, l2_dir: str) -> EngineConfig:
    return EngineConfig(
        chunk_size=args.chunk_size, l1_size=args.l1_size, l2_path=l2_dir, l2_size=args.l2_size
    )


async def _serve_turn(
    engine: TieredKVEngine,
    model: SimulatedModel,
    prompt: list[int],
    rng: random.Random,
    report: DemoReport,
) -> int:
    keys = engine.chunk_keys(prompt)
    hit = await engine.lookup(prompt)
    blocks = model.allocate_blocks(len(prompt), rng)
    try:
        valid = (await engine.retrieve(prompt, blocks)).valid_tokens
        if valid < hit:
            # Not an error: a chunk could not be loaded in time or into L1 (retrieve releases
            # each scattered batch, so this needs L1 nearly full of referenced chunks); the
            # engine computes the rest.
            report.short_retrieves += 1
        # The model's work runs off the loop, as a serving engine's model runner does: the
        # loop keeps serving the lower tiers' completions meanwhile.
        good, bad = await asyncio.to_thread(model.verify, keys, blocks, valid)
        report.verified_chunks += good
        report.mismatched_chunks += bad
        await asyncio.to_thread(model.prefill, keys, blocks, valid, len(prompt))
        await engine.store(prompt, blocks)
    finally:
        model.free(blocks)
    report.prompt_tokens += len(prompt)
    report.hit_tokens += valid
    report.computed_tokens += len(prompt) - valid
    return valid


async def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    rng = random.Random(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    spec = DemoModel()
    with contextlib.ExitStack() as stack:
        l2_dir = args.l2_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="tkv-l2-"))
        config = _demo_config(args, l2_dir)
        model = SimulatedModel(spec, device, config.chunk_size)
        system_prompt = [rng.randrange(1, 32000) for _ in range(args.system_tokens)]
        users = [Conversation(list(system_prompt)) for _ in range(args.users)]
        report = DemoReport()
        progress = Progress(args.users * args.turns + args.users, "demo")
        started = time.perf_counter()
        async with TieredKVEngine(config) as engine:
            engine.register_kv_caches(
                model.caches, model_name="demo-model", layout_hints=model.layout_hints
            )
            for turn in range(args.turns):
                for user in users:
                    user.history += [rng.randrange(1, 32000) for _ in range(rng.randint(64, 400))]
                    await _serve_turn(engine, model, user.history, rng, report)
                    user.history += [rng.randrange(1, 32000) for _ in range(rng.randint(32, 200))]
                    report.turns += 1
                    progress.advance(f"turn {turn + 1}")
            await engine.flush()
            before = _DemoStats.of(engine.stats())
        # Restart on the same L2 directory: a new process would see the same thing.
        async with TieredKVEngine(config) as engine:
            engine.register_kv_caches(
                model.caches, model_name="demo-model", layout_hints=model.layout_hints
            )
            for user in users:
                report.restart_prompt_tokens += len(user.history)
                report.restart_hit_tokens += await _serve_turn(
                    engine, model, user.history, rng, report
                )
                progress.advance("after restart")
            after = _DemoStats.of(engine.stats())
        elapsed = time.perf_counter() - started
    _print_report(out, report, before, after, elapsed, device, config, spec)
    return 0 if report.mismatched_chunks == 0 and report.verified_chunks > 0 else 1


@dataclasses.dataclass(frozen=True, slots=True)
class _DemoStats:
    """The sections of an open engine's `EngineStats` that the demo's report reads."""

    l1: L1Stats
    storage: StorageStats
    mover: MoverStats
    l2_reads: TierReadStats
    l2_writes: WriteQueueStats

    @classmethod
    def of(cls, stats: EngineStats) -> _DemoStats:
        storage, l1, mover = stats.storage, stats.l1, stats.mover
        l2 = None if storage is None else storage.tier("L2")
        if storage is None or l1 is None or mover is None or l2 is None or l2.writes is None:
            raise EngineStateError("tiered-kv demo: statistics taken from a closed engine")
        return cls(l1, storage, mover, l2.reads, l2.writes)


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:7.2f} GB/s" if seconds > 0 else "      n/a"


def _per_op(seconds: float, count: float) -> float | None:
    return seconds / count if count else None


def _print_report(
    out: TextIO,
    report: DemoReport,
    before: _DemoStats,
    after: _DemoStats,
    elapsed: float,
    device: torch.device,
    config: EngineConfig,
    spec: DemoModel,
) -> None:
    def total(read: Callable[[_DemoStats], float]) -> float:
        return read(before) + read(after)

    w = out.write
    w("\ntiered_kv demo\n")
    w(
        f"  device {device}, {spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
        f"{spec.head_size} ({spec.dtype}), chunk {config.chunk_size} tokens, "
        f"L1 {format_size(config.l1_bytes)}, L2 {config.l2_path}\n"
    )
    w(
        f"  {report.turns} turns + restart replay in {elapsed:.1f} s; prompt tokens "
        f"{report.prompt_tokens}, restored from cache {report.hit_tokens} "
        f"({100 * report.hit_tokens / max(report.prompt_tokens, 1):.0f}%), computed "
        f"{report.computed_tokens}\n\n"
    )
    w(f"  {'hits (chunks)':<26}{'before restart':>16}{'after restart':>16}\n")
    hits: list[tuple[str, Callable[[_DemoStats], int]]] = [
        ("L1", lambda stats: stats.storage.l1_hits),
        ("L2", lambda stats: stats.l2_reads.hits),
        ("L1 evictions", lambda stats: stats.l1.evictions),
    ]
    for name, count in hits:
        w(f"  {name:<26}{count(before):>16}{count(after):>16}\n")
    w("\n")
    # Throughput is bytes over the time the path was busy (at least one operation running),
    # never over the sum of overlapping per-operation latencies; latency is shown on its own.
    rows = [
        (
            "device -> L1 (store)",
            total(lambda stats: stats.mover.bytes_gathered),
            total(lambda stats: stats.mover.gather_seconds),
            None,
        ),
        (
            "L1 -> device (retrieve)",
            total(lambda stats: stats.mover.bytes_scattered),
            total(lambda stats: stats.mover.scatter_seconds),
            None,
        ),
        (
            "L1 -> L2 (disk write)",
            total(lambda stats: stats.l2_writes.bytes_written),
            total(lambda stats: stats.l2_writes.busy_seconds),
            _per_op(
                total(lambda stats: stats.l2_writes.write_seconds),
                total(lambda stats: stats.l2_writes.done),
            ),
        ),
        (
            "L2 -> L1 (disk read)",
            total(lambda stats: stats.l2_reads.bytes_read),
            total(lambda stats: stats.l2_reads.busy_seconds),
            _per_op(
                total(lambda stats: stats.l2_reads.read_seconds),
                total(lambda stats: stats.l2_reads.hits),
            ),
        ),
    ]
    w(f"  {'path':<26}{'bytes':>16}{'throughput':>16}{'latency/chunk':>16}\n")
    for name, nbytes, seconds, latency in rows:
        per_op = f"{latency * 1e3:10.2f} ms" if latency is not None else f"{'':>13}"
        w(f"  {name:<26}{format_size(nbytes):>16}{_rate(nbytes, seconds):>16}{per_op:>16}\n")
    verdict = "OK" if report.mismatched_chunks == 0 and report.verified_chunks else "FAILED"
    w(
        f"\n  restart replay: {report.restart_hit_tokens}/{report.restart_prompt_tokens} prompt "
        f"tokens restored from cache\n"
    )
    w(f"  short retrieves (L1 too full to hold a whole cached prefix): {report.short_retrieves}\n")
    w(
        f"  verification: {report.verified_chunks} retrieved chunks checked bit for bit, "
        f"{report.mismatched_chunks} mismatches -> {verdict}\n"
    )


# -- inspect ------------------------------------------------------------------------------------
def run_inspect(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from tiered_kv.tiers.l2 import scan_directory

    root = Path(args.directory)
    if not root.is_dir():
        print(f"tiered-kv inspect: {root} is not a directory", file=sys.stderr)
        return 2
    files = scan_directory(root)
    w = out.write
    w(f"{'file':<36}{'tokens':>7}{'size':>12}  {'model':<16}{'namespace':<12}groups\n")
    good_bytes = 0
    bad = 0
    for item in files:
        name = Path(item.path).name[:34]
        if item.error is not None or item.key is None:
            bad += 1
            w(f"{name:<36}{'-':>7}{format_size(item.size):>12}  CORRUPT: {item.error}\n")
            continue
        good_bytes += item.size
        groups = ", ".join(f"{g.dtype}{list(g.shape)}" for g in item.groups)
        scope = item.key.scope
        layer = "" if item.key.layer is None else f" layer {item.key.layer}"
        w(
            f"{name:<36}{item.num_tokens:>7}{format_size(item.size):>12}  {scope.model:<16}"
            f"{scope.namespace or '-':<12}{groups}{layer}\n"
        )
    w(f"\n{len(files) - bad} chunks, {format_size(good_bytes)}; {bad} corrupt or foreign files\n")
    return 0


# -- serve --------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    from tiered_kv.config import parse_size
    from tiered_kv.errors import ConfigError
    from tiered_kv.tiers.l3_remote import read_token_file
    from tiered_kv.tiers.remote.server import ServerOptions, serve

    try:
        token = None if args.token_file is None else read_token_file(args.token_file)
        options = ServerOptions(
            host=args.host,
            port=args.port,
            capacity=parse_size(args.capacity, name="capacity"),
            token=token,
            max_connections=args.max_connections,
            header_timeout_s=args.header_timeout or None,
            idle_timeout_s=args.idle_timeout or None,
            max_auth_bytes=args.max_auth_bytes,
            read_delay_s=args.read_delay,
        )
    except ConfigError as exc:
        print(f"tiered-kv serve: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(options))
    except OSError as exc:
        print(f"tiered-kv serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0


# -- bench --------------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace) -> int:
    from tiered_kv.benchmarks import run_benchmark

    return run_benchmark(args.name, args.args, prog=f"tiered-kv bench {args.name}")


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="simulate a multi-turn workload and verify every hit")
    demo.add_argument("--users", type=int, default=6)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--system-tokens", type=int, default=1024)
    demo.add_argument("--chunk-size", type=int, default=256)
    demo.add_argument("--l1-size", default="24MiB", help="small, so some hits come from disk")
    demo.add_argument("--l2-size", default="4GiB")
    demo.add_argument("--l2-dir", default=None, help="default: a temporary directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cpu", action="store_true", help="use CPU tensors even with a GPU")
    from tiered_kv.benchmarks import BENCHMARKS

    bench = sub.add_parser(
        "bench",
        help="run a benchmark shipped with the package (table + PNG plots)",
        description="Run a benchmark on embedded defaults; it measures this machine's ceilings "
        "in the same run, prints a table last and writes PNG plots (the 'bench' extra: "
        "matplotlib; --no-plot for the table alone). Options after NAME go to the benchmark: "
        "`tiered-kv bench workload --help`. Benchmarks: "
        + "; ".join(f"{name}: {text}" for name, text in BENCHMARKS.items()),
    )
    bench.add_argument("name", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark")
    inspect = sub.add_parser("inspect", help="list the chunks an L2 directory holds")
    inspect.add_argument("directory")
    serve = sub.add_parser("serve", help="run the built-in remote cache server (tkv://)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=7474, help="0 picks a free port")
    serve.add_argument("--capacity", default="64GiB", help="bytes of chunks kept (LRU beyond)")
    serve.add_argument("--token-file", default=None, help="shared token clients must present")
    from tiered_kv.tiers.remote.server import ServerOptions

    defaults = ServerOptions()  # the defaults live there
    serve.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="connections served at once, more are refused; keep below `ulimit -n` "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout_s,
        metavar="SECONDS",
        help="bound on a request's header and meta, and on AUTH after connecting; 0: none "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        metavar="SECONDS",
        help="close a connection that neither sends nor takes a byte for this long; 0: never "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--max-auth-bytes",
        type=int,
        default=defaults.max_auth_bytes,
        help="largest AUTH read before a connection has authenticated (default: %(default)s)",
    )
    serve.add_argument(
        "--read-delay",
        type=float,
        default=defaults.read_delay_s,
        metavar="SECONDS",
        help="wait this long before answering each read: a slow or distant store, to test "
        "and measure what clients do then (default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        loop = new_event_loop()
        try:
            return loop.run_until_complete(run_demo(args))
        finally:
            loop.close()
    if args.command == "bench":
        return run_bench(args)
    if args.command == "inspect":
        return run_inspect(args)
    if args.command == "serve":
        return run_serve(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
