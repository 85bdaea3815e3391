"""Admission: whether a generate call may go to the engines now, from the engines' own KV figures.

Pure core (no asyncio, no I/O, injected monotonic ``now``): capacity parsing (capacity), reservation estimates
(reservation), the token ledger (ledger; its figures: ledger_figures) and its working sets (working_set), the
engines ordered by free room (free_rank), the global FIFO around it (coordinator), which requests admission
may hold (policy), and the program policy (program: ProgramCoordinator;
its parts: program_queue the waiting turns, program_pause the pauses, victims the victim and resume rules,
seats the resident bound, turn_gaps when a program counts as ended, deadlines the heap of deadlines that go
stale, records its records and wait reasons). Edges: the asyncio gate that parks waiting requests (gate) and
the capacity poller (poller).
May import kvgate.common (the admission seam it implements, kvgate.common.admission_seam, and the metric declarations)."""

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
