"""Whether loading a cached prefix beats recomputing it: per-tier load costs learned from the
tier's own reads, a recompute model, and the claim that minimises the expected time to first
token (`choose_claim`).

`TierCost` learns one lower tier's time per chunk read, ``latency + bytes x in_flight /
throughput`` (the reads in flight share the tier's bandwidth: a disk or a link is busy with
all of them), by least squares over its recent reads (exponential forgetting, so it follows a
tier that slows down or recovers; each read's time clipped to a few times the current
prediction, so one stall does not swing it). A load of k chunks takes ``ceil(k /
parallelism)`` rounds of ``min(k, parallelism)`` reads in flight. Until a tier has read a few
chunks it has no estimate, unless seeded (`seed`).

`RecomputeCost` learns the prefill time of ``new`` tokens over a resident prefix of ``prefix``
tokens as ``a·new + b·new·prefix + c·new²/2 + d`` (the matmuls, the attention over the prefix,
the causal attention among the new tokens, a fixed part) from the prefills the serving stack
reports, fitted for relative error with every coefficient >= 0, or takes a function of its
own. Until it has seen `MIN_PREFILLS` prefills it has no estimate.

`choose_claim` compares, for every chunk boundary k of a located prefix, the time to first
token when the first k chunks are loaded and the rest recomputed, ``load(k) + compute(rest)``,
layerwise loads included: a model's first layer needs every claimed chunk, and a lower tier
delivers a chunk whole, so its reads end before the first layer computes (what a layerwise
load overlaps with the model is the copy from host memory, not counted here). Loads from
different tiers run at once (the slowest tier's time counts); chunks in L1 cost nothing here.
Without an estimate for a tier it needs, or for recomputing, it claims the whole located prefix
(loading is the conservative default: a claim never costs correctness, and a hit is usually
faster).
A declined tier is read no more, so the engine reads one of its declined chunks into L1 at
most every `PROBE_INTERVAL_S` (`TierCost.probe_due`): its estimate keeps following the tier.

Loop-only; pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

MIN_READS = 4  # reads before a tier's own estimate is used
MIN_PREFILLS = 3  # prefills before the recompute model estimates (three shapes fit three terms)
PROBE_INTERVAL_S = 10.0  # a tier whose hits are declined gets one chunk read this often
_CLIP = 4.0  # an observation counts at most this many times the current prediction


class _DecayingFit:
    """Weighted least squares of ``y`` on features ``x`` (with forgetting factor ``keep`` per
    observation); solves by Gaussian elimination, None while the system is singular."""

    def __init__(self, features: int, keep: float) -> None:
        self.keep = keep
        self.count = 0
        self._xtx = [[0.0] * features for _ in range(features)]
        self._xty = [0.0] * features
        self._yty = 0.0
        self._solved: tuple[list[float] | None] | None = None  # until the next `add`
        self._nonnegative: tuple[list[float] | None] | None = None  # likewise

    def add(self, x: Sequence[float], y: float) -> None:
        n = len(self._xty)
        self._yty = self.keep * self._yty + y * y
        for i in range(n):
            self._xty[i] = self.keep * self._xty[i] + x[i] * y
            row = self._xtx[i]
            for j in range(n):
                row[j] = self.keep * row[j] + x[i] * x[j]
        self.count += 1
        self._solved = None
        self._nonnegative = None

    def solve(self) -> list[float] | None:
        if self._solved is None:
            self._solved = (self._solve(),)
        return self._solved[0]

    def solve_nonnegative(self) -> list[float] | None:
        """The least-squares fit with every coefficient >= 0 (non-negative least squares),
        found exactly: the solvable subset of features whose own fit is non-negative and leaves
        the least squared error, the others set to 0 (of fits within a hair of each other, the
        one with fewer features). Features never seen (all zero) are left out; so is any subset
        the observations cannot pin down (a singular system), so a few distinct prefill shapes
        still give an estimate from the terms they do determine. None when no subset is
        solvable."""
        if self._nonnegative is None:
            self._nonnegative = (self._solve_nonnegative(),)
        return self._nonnegative[0]

    def _solve_nonnegative(self) -> list[float] | None:
        seen = [i for i in range(len(self._xty)) if self._xtx[i][i] > 0]
        scale = max(self._yty, 1e-300)
        best: tuple[float, Sequence[int], list[float]] | None = None
        for size in range(1, len(seen) + 1):
            for subset in itertools.combinations(seen, size):
                solved = self._solve(subset)
                if solved is None or min(solved) < 0:
                    continue
                error = self._squared_error(subset, solved)
                if best is None or error < best[0] - 1e-9 * scale:
                    best = (error, subset, solved)
        if best is None:
            return None
        out = [0.0] * len(self._xty)
        for index, value in zip(best[1], best[2], strict=True):
            out[index] = value
        return out

    def _squared_error(self, active: Sequence[int], coef: Sequence[float]) -> float:
        """The weighted sum of squared residuals of the fit ``coef`` over features ``active``."""
        error = self._yty
        for a, i in enumerate(active):
            error -= 2.0 * coef[a] * self._xty[i]
            for b, j in enumerate(active):
                error += coef[a] * coef[b] * self._xtx[i][j]
        return max(error, 0.0)

    def _solve(self, active: Sequence[int] | None = None) -> list[float] | None:
        idx = list(range(len(self._xty))) if active is None else list(active)
        n = len(idx)
        # Columns scaled to a unit diagonal first: the features differ by many orders.
        d = [math.sqrt(self._xtx[i][i]) for i in idx]
        if not all(v > 0 for v in d):
            return None
        a = [
            [*(self._xtx[i][j] / (d[r] * d[c]) for c, j in enumerate(idx)), self._xty[i] / d[r]]
            for r, i in enumerate(idx)
        ]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) <= 1e-9:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(n):
                if r != col:
                    f = a[r][col] / a[col][col]
                    for c in range(col, n + 1):
                        a[r][c] -= f * a[col][c]
        return [a[i][n] / a[i][i] / d[i] for i in range(n)]


class TierCost:
    """One lower tier's read cost, learned from its reads (see the module docstring)."""

    def __init__(self, name: str, parallelism: int, *, keep: float = 0.9) -> None:
        if parallelism < 1:
            raise ValueError(f"TierCost {name}: parallelism must be >= 1, got {parallelism}")
        self.name = name
        self.parallelism = parallelism
        self._fit = _DecayingFit(2, keep)
        self._mean_shared = 0.0  # mean of bytes x reads in flight, over the reads seen
        self._mean_seconds = 0.0
        self._mean_bytes = 0.0
        self._weight = 0.0
        self._keep = keep
        self._seed: tuple[float, float] | None = None  # (latency s, bytes per second)
        self._last_probe = -math.inf  # when `probe_due` last said yes

    def probe_due(self, now: float, interval_s: float | None = None) -> bool:
        """Whether a tier whose hits are declined should read one chunk anyway now, so that its
        estimate follows the tier when it speeds up (declined hits are never read otherwise).
        Says yes at most once per ``interval_s`` (default `PROBE_INTERVAL_S`)."""
        interval = PROBE_INTERVAL_S if interval_s is None else interval_s
        if now - self._last_probe < interval:
            return False
        self._last_probe = now
        return True

    def seed(self, *, throughput_bps: float, latency_s: float = 0.0) -> None:
        """A prior (e.g. the tier's ceiling measured in the same run: an aggregate rate, shared
        by the reads in flight), used until it has read `MIN_READS` chunks itself."""
        if throughput_bps <= 0 or latency_s < 0:
            raise ValueError(
                f"TierCost {self.name}: seed needs throughput > 0 and latency >= 0, got "
                f"{throughput_bps} B/s and {latency_s} s"
            )
        self._seed = (latency_s, throughput_bps)

    @property
    def reads(self) -> int:
        return self._fit.count

    def observe(
        self, nbytes: int, seconds: float, cached: bool | None = None, concurrency: int = 1
    ) -> None:
        """One chunk read: ``nbytes`` in ``seconds``, with ``concurrency`` reads of the tier in
        flight when it started (itself included). ``cached``: whether the tier found it in the
        page cache (`PageCachedTierCost` keeps the two apart; here it is not used)."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        concurrency = max(1, concurrency)
        predicted = self.chunk_seconds(nbytes, concurrency)
        if predicted is not None and self._fit.count >= MIN_READS:
            seconds = min(seconds, _CLIP * predicted)
        shared = float(nbytes) * concurrency
        self._fit.add((1.0, shared), seconds)
        self._weight = self._keep * self._weight + 1.0
        w = 1.0 / self._weight
        self._mean_shared += w * (shared - self._mean_shared)
        self._mean_seconds += w * (seconds - self._mean_seconds)
        self._mean_bytes += w * (nbytes - self._mean_bytes)

    def _own(self) -> tuple[float, float] | None:
        """(latency s, seconds per shared byte) from the reads seen, None before `MIN_READS`."""
        if self._fit.count < MIN_READS:
            return None
        solved = self._fit.solve()
        if solved is not None and solved[0] >= 0 and solved[1] > 0:
            return solved[0], solved[1]
        # Reads all alike (one size, one concurrency), or a fit that makes no physical sense:
        # time is proportional to the bytes in flight.
        if self._mean_shared <= 0:
            return None
        return 0.0, self._mean_seconds / self._mean_shared

    def chunk_seconds(self, nbytes: int, concurrency: int = 1) -> float | None:
        """Predicted time of one chunk's read with ``concurrency`` reads in flight (they share
        the tier's bandwidth), None while there is no estimate."""
        own = self._own()
        if own is not None:
            latency, per_byte = own
            return latency + per_byte * nbytes * concurrency
        if self._seed is not None:
            latency, rate = self._seed
            return latency + nbytes * concurrency / rate
        return None

    def load_seconds(self, chunk_bytes: Sequence[int]) -> float | None:
        """Predicted time to read these chunks, `parallelism` at a time; 0 for none."""
        if not chunk_bytes:
            return 0.0
        return self.chunks_seconds(len(chunk_bytes), round(sum(chunk_bytes) / len(chunk_bytes)))

    def chunks_seconds(self, count: int, nbytes: int) -> float | None:
        """Predicted time to read ``count`` chunks of ``nbytes``: ``ceil(count / parallelism)``
        rounds of `parallelism` reads (fewer when ``count`` is smaller) sharing the tier."""
        if count <= 0:
            return 0.0
        one = self.chunk_seconds(nbytes, min(count, self.parallelism))
        if one is None:
            return None
        return math.ceil(count / self.parallelism) * one

    def throughput_bps(self) -> float | None:
        """Aggregate bytes per second at full parallelism for chunks of the usual size."""
        size = self._mean_bytes or None
        if size is None:
            return None
        one = self.chunk_seconds(round(size), self.parallelism)
        if one is None or one <= 0:
            return None
        return self.parallelism * size / one


class PageCachedTierCost(TierCost):
    """A tier whose reads run at two speeds, its files in the page cache or read from the
    device (L2): besides the estimate from all its reads (the `TierCost` itself), one from the
    cached reads and one from the others. `expect_cached` (the tier's probe of the located
    chunks, before each claim) says which mix the next load will be; without it, or while
    either kind has no estimate, the estimate from all reads stands."""

    def __init__(self, name: str, parallelism: int, *, keep: float = 0.9) -> None:
        super().__init__(name, parallelism, keep=keep)
        self.cached = TierCost(f"{name} (page cache)", parallelism, keep=keep)
        self.uncached = TierCost(f"{name} (device)", parallelism, keep=keep)
        self.cached_share: float | None = None

    def expect_cached(self, share: float | None) -> None:
        """The share of the chunks about to be claimed that are in the page cache (None:
        unknown)."""
        self.cached_share = None if share is None else min(max(share, 0.0), 1.0)

    def observe(
        self, nbytes: int, seconds: float, cached: bool | None = None, concurrency: int = 1
    ) -> None:
        super().observe(nbytes, seconds, concurrency=concurrency)
        if cached is not None:
            model = self.cached if cached else self.uncached
            model.observe(nbytes, seconds, concurrency=concurrency)

    def chunks_seconds(self, count: int, nbytes: int) -> float | None:
        share = self.cached_share
        if share is None or count <= 0:
            return super().chunks_seconds(count, nbytes)
        warm = round(count * share)
        parts = ((self.cached, warm), (self.uncached, count - warm))
        total = 0.0
        for model, chunks in parts:
            if not chunks:
                continue
            one = model.chunk_seconds(nbytes, min(chunks, self.parallelism))
            if one is None:
                return super().chunks_seconds(count, nbytes)
            total += math.ceil(chunks / self.parallelism) * one
        return total


class RecomputeCost:
    """Prefill seconds of ``new`` tokens over a resident prefix of ``prefix`` tokens: learned
    from `observe` (see the module docstring), or ``function(new, prefix)`` when given."""

    def __init__(
        self, function: Callable[[int, int], float] | None = None, *, keep: float = 0.98
    ) -> None:
        self.function = function
        self._fit = _DecayingFit(4, keep)

    @staticmethod
    def _features(new: int, prefix: int) -> tuple[float, float, float, float]:
        # The matmuls, the attention over the resident prefix, the causal attention among the
        # new tokens (a prefix runs another attention kernel: on an H200, 16384 new tokens over
        # 16384 cached took longer than all 32768 from scratch), a fixed part.
        return float(new), float(new) * prefix, new * new / 2.0, 1.0

    @property
    def observations(self) -> int:
        return self._fit.count

    def observe(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        if new_tokens <= 0 or prefix_tokens < 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        # Relative error is what is fitted (each row divided by its seconds): prefills span
        # three orders of magnitude, and a plain fit lets the longest ones set every estimate.
        features = self._features(new_tokens, prefix_tokens)
        self._fit.add([f / seconds for f in features], 1.0)

    def seconds(self, new_tokens: int, prefix_tokens: int) -> float | None:
        if new_tokens <= 0:
            return 0.0
        if self.function is not None:
            return float(self.function(new_tokens, prefix_tokens))
        if self._fit.count < MIN_PREFILLS:
            return None
        # Every coefficient of a physical model is >= 0, and a term the prefills seen cannot pin
        # down is left out: a few short ones over a prefix on a loaded CPU gave the prefix a
        # negative one (a prompt's compute shrank with its prefix), and three prefill shapes
        # leave four terms undetermined (no estimate at all, so every hit was loaded).
        solved = self._fit.solve_nonnegative()
        if solved is None:
            return None
        features = self._features(new_tokens, prefix_tokens)
        value = sum(c * f for c, f in zip(solved, features, strict=True))
        return max(value, 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """What `choose_claim` decided: load the first ``chunks`` located chunks."""

    chunks: int
    located: int  # chunks the lookup found
    expected_s: float | None  # expected time to first token with this claim (None: no model)
    all_loaded_s: float | None  # the same with every located chunk loaded
    # Per lower tier index: chunks located there and left unclaimed.
    declined: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def saved_s(self) -> float:
        """Expected seconds saved against loading every located chunk (0 without a model)."""
        if self.expected_s is None or self.all_loaded_s is None:
            return 0.0
        return max(self.all_loaded_s - self.expected_s, 0.0)


def choose_claim(
    where: Sequence[int],
    *,
    chunk_tokens: int,
    chunk_bytes: int,
    total_tokens: int,
    tiers: Sequence[TierCost],
    recompute: RecomputeCost,
) -> Claim:
    """The prefix of ``where`` (a located prefix, `tiered_kv.storage.StorageManager.locate`: a
    negative location is L1 (`tiered_kv.storage.IN_L1`), ``i`` is ``tiers[i]``) worth loading
    for a prompt of ``total_tokens``; see the module docstring."""
    located = len(where)
    everything = Claim(located, located, None, None)
    if not any(w >= 0 for w in where):
        return everything
    best: tuple[float, int] | None = None
    all_loaded: float | None = None
    per_tier: dict[int, int] = {}
    for k in range(located + 1):
        if k:
            tier = where[k - 1]
            if tier >= 0:
                per_tier[tier] = per_tier.get(tier, 0) + 1
        load = 0.0
        for tier, count in per_tier.items():
            seconds = tiers[tier].chunks_seconds(count, chunk_bytes)
            if seconds is None:
                return everything  # no estimate for a tier this claim needs: load it all
            load = max(load, seconds)
        prefix = min(k * chunk_tokens, total_tokens)
        rest = recompute.seconds(total_tokens - prefix, prefix)
        if rest is None:
            return everything
        ttft = load + rest
        if best is None or ttft <= best[0]:
            best = (ttft, k)
        if k == located:
            all_loaded = ttft
    assert best is not None
    chunks = best[1]
    declined: dict[int, int] = {}
    for tier in where[chunks:]:
        if tier >= 0:
            declined[tier] = declined.get(tier, 0) + 1
    return Claim(chunks, located, best[0], all_loaded, declined)
