"""Program-aware admission core (issue 3): pure capacity parsing, reservation estimates, the token ledger,
the global FIFO coordinator and the scope policy. No asyncio and no I/O here: the aiohttp shell, pollers and
Prometheus registration live elsewhere and drive these objects with a monotonic ``now``."""

from .capacity import (
    ClusterSnapshot,
    EngineCapacity,
    Pool,
    parse_engine_loads,
    parse_engine_metrics,
    stale_after_s,
)
from .coordinator import ADMISSION_OFF, AdmissionCoordinator, Decision, Kind
from .ledger import REFUSAL_REASONS, Grant, Lease, Ledger, Refusal
from .policy import HEADER_PROTECTED, HEADER_SCOPE, MatchRule, ScopeRules, classify_scope
from .reservation import (
    DEFAULT_CHARS_PER_TOKEN,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    estimate_reservation,
    estimate_text_tokens,
    load_tokenizer_counter,
)

__all__ = [
    "ADMISSION_OFF",
    "AdmissionCoordinator",
    "ClusterSnapshot",
    "DEFAULT_CHARS_PER_TOKEN",
    "Decision",
    "EngineCapacity",
    "Grant",
    "HEADER_PROTECTED",
    "HEADER_SCOPE",
    "Kind",
    "Lease",
    "Ledger",
    "MatchRule",
    "Pool",
    "REFUSAL_REASONS",
    "Refusal",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "ScopeRules",
    "classify_scope",
    "estimate_reservation",
    "estimate_text_tokens",
    "load_tokenizer_counter",
    "parse_engine_loads",
    "parse_engine_metrics",
    "stale_after_s",
]
