"""The program policy's figures: programs by place and state, the resident bound's seats, and /kvgate/stats (pure).

Part of :class:`kvgate.admission.program.ProgramCoordinator` (a base class of it: the methods read the
coordinator's records).
"""

from __future__ import annotations

from typing import Any

from .records import BOUND_REASON, ProgramState, one_turn

__all__: list[str] = []


class _Figures:
    """The figures half of ProgramCoordinator; no state of its own."""

    def program_states(self, now: float | None = None) -> dict[str, dict[str, int]]:
        """{place label: {state: programs}} (one-turn requests without a session are not programs); with
        ``now``, programs in a tool call past their predicted gap count as ``ended``."""
        out: dict[str, dict[str, int]] = {}
        for p in self._programs.values():
            if one_turn(p.sid):
                continue
            d = out.setdefault(self._label(p.place), {s.value: 0 for s in ProgramState})
            state = p.state
            if state is ProgramState.IN_TOOL and now is not None and p.overdue_at <= now:
                state = ProgramState.ENDED
            d[state.value] += 1
        return out

    def seats(self, now: float) -> dict[str, dict[str, int]]:
        """The resident bound by place label: {resident: programs holding KV there, kept_for_paused: seats kept
        for paused programs expected back, limit: max_resident x the place's KV pools}; {} while it is off."""
        return self._bound.by_place(self._label)

    def stats(self, now: float) -> dict[str, Any]:
        """JSON-able figures: counters, waiting (resumes / new; waiting_bound: for a seat), programs by place and
        state, pauses and resumes by place, the resident bound's seats by place, window rates and the ledger's
        figures."""
        return {
            "policy": "program",
            "counters": dict(self.counters),
            "waiting": self.waiting,
            "waiting_resume": sum(1 for w in self._queue.values() if w.resume),
            "window_s": self.window_s,
            **self.tally.window(now),
            "max_wait_s": self.max_wait_s,
            "wait_bound": self.wait_bound,
            "prefill_tokens_per_s": self.prefill.stats(self._label),
            "pause_gate": self.gate.stats(now, len(self.ledger.engine_places())),
            "victim": self.victim.value,
            "resume_order": self.resume.value,
            "programs": self.program_states(now),
            "overdue_multiple": self.overdue_multiple,
            "resume_deadline_s": self.resume_deadline_s,
            "max_resident": self.max_resident,
            "waiting_bound": sum(1 for w in self._queue.values() if w.reason == BOUND_REASON),
            "seats": self.seats(now),
            "pauses": dict(self.pauses),
            "resumes": dict(self.resumes),
            "ledger": self.ledger.stats(now),
        }
