"""Real SGLang engines for ``kvgate bench`` (scenario ``engine: sglang``; edge): started with the one launcher
(kvgate.tools.sglang_engine) and reused across arms and seeds.

A start costs 20-30 s, so the bench keeps its engines while the next run wants the same KV pool and flushes
their radix cache between runs (POST /flush_cache: an empty tree, as a fresh engine has); a run that wants
another pool size (unbounded-kv) stops them and starts new ones. What a run did on the engines comes from the
difference of their Prometheus counters before and after it (``engine_totals``), since a real engine has no
/sim/stats.
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgate.tools.sglang_engine import Engine, EngineSpec, flush_cache, start_engine

# sglang:NAME (0.5.23 /metrics) -> the bench's totals key (the same keys /sim/stats totals uses)
COUNTERS = {
    "sglang:prompt_tokens_total": "prompt_tokens",
    "sglang:cached_tokens_total": "cached_tokens",
    "sglang:generation_tokens_total": "generation_tokens",
    "sglang:evicted_tokens_total": "evicted_tokens",
    "sglang:num_retracted_requests_total": "retractions",
    "sglang:num_aborted_requests_total": "aborted",
    "sglang:num_requests_total": "num_requests",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS of one /metrics exposition, summed over their label sets (engine totals). A counter absent
    from the text (SGLang exports the retraction counters only after the first retraction) is 0."""
    out = {k: 0.0 for k in COUNTERS.values()}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in COUNTERS:
            out[COUNTERS[m.group(1)]] += float(m.group(3))
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """GET url/metrics -> parse_counters. Raises OSError when the engine does not answer."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
        return parse_counters(resp.read().decode("utf-8", "replace"))


def totals_delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    """Counters gained between two scrapes of the same engines, summed over the engines."""
    out: dict[str, float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            out[k] = out.get(k, 0.0) + v - b.get(k, 0.0)
    return out


class EnginePool:
    """The bench's real engines: ``count`` engines of the ``profile`` model, logged under ``log_dir``.
    ``urls(pool_tokens)`` hands out engines with that KV pool and an empty cache; ``stop()`` ends them all."""

    def __init__(self, count: int, profile: str, log_dir: Path, extra: list[str] | None = None,
                 start_timeout_s: float = 900.0):
        self.count, self.profile, self.log_dir = count, profile, log_dir
        self.start_timeout_s = start_timeout_s
        self.extra = [str(x) for x in extra or []]
        self.engines: list[Engine] = []
        self.pool_tokens: int | None = None
        self.starts = 0

    def urls(self, pool_tokens: int) -> list[str]:
        """Engines with ``pool_tokens`` of KV each and an empty radix cache: the running ones flushed, or
        (another pool size, or none yet) new ones. Raises what start_engine / flush_cache raise."""
        if self.engines and self.pool_tokens == pool_tokens and all(e.proc.popen.poll() is None
                                                                   for e in self.engines):
            for e in self.engines:
                flush_cache(e.url)
            return [e.url for e in self.engines]
        self.stop()
        spec = EngineSpec(max_total_tokens=pool_tokens, profile=self.profile, served_model_name="kvgate-sim",
                          extra=self.extra)
        # side by side: a start is mostly waiting (imports, a warm-up) and takes minutes on a busy machine
        with ThreadPoolExecutor(self.count) as ex:
            futs = [ex.submit(start_engine, spec, self.log_dir, f"sglang{i}-pool{pool_tokens}", None,
                              self.start_timeout_s) for i in range(self.count)]
            errors = []
            for f in futs:
                try:
                    self.engines.append(f.result())
                    self.starts += 1
                except BaseException as exc:  # noqa: BLE001 - the others are stopped, the first error raised
                    errors.append(exc)
        if errors:
            self.stop()
            raise errors[0]
        self.pool_tokens = pool_tokens
        return [e.url for e in self.engines]

    def stop(self) -> None:
        """Stop every engine (each by its process group) and give the slots back."""
        while self.engines:
            self.engines.pop().stop()
        self.pool_tokens = None
