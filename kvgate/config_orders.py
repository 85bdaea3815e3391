"""Rules between two configuration keys (pure): ``admission_pause_stop_ratio <= admission_pause_start_ratio``,
``session_idle_floor_s <= session_idle_ceiling_s``.

A rule is checked exactly when the two keys' own ranges are (kvgate.config.Key.only_when): a rule between the
numbers of a feature that is off is no error, only the warning that the key does nothing
(kvgate.config_checks), which says the value would then be refused. A refusal names the key the user wrote (set
away from its default), not the other one, and says what to set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Order:
    """A rule between two keys: ``low`` <= ``high``, except while ``high`` is ``high_off`` (a value that turns
    the rule's subject off: admission_pause_start_ratio 0 pauses whatever re-prefill costs)."""

    low: str
    high: str
    high_off: float | None = None


def applies(order: Order, values: Mapping[str, Any], gates: Mapping[str, str | None]) -> bool:
    """Whether ``order`` is checked with ``values``: the boolean keys gating its keys' ranges (``gates``: key ->
    Key.only_when) are on."""
    return all(values[g] for g in (gates[order.low], gates[order.high]) if g)


def broken(order: Order, values: Mapping[str, Any]) -> bool:
    """Whether ``values`` break ``order`` (whatever its feature)."""
    lo, hi = values[order.low], values[order.high]
    return lo > hi and not (order.high_off is not None and hi == order.high_off)


def named(order: Order, written: set[str]) -> str:
    """The key a broken ``order`` is refused under: the one the user wrote (the low one when both or neither)."""
    return order.high if order.high in written and order.low not in written else order.low


def allowed(order: Order, values: Mapping[str, Any], written: set[str]) -> str:
    """What the named key of ``order`` must be, given the other's value: ``<= session_idle_ceiling_s (900.0, its
    default)``."""
    if named(order, written) == order.low:
        return f"<= {order.high} ({values[order.high]}" + (", its default)" if order.high not in written else ")")
    off = f" or {order.high_off:g}" if order.high_off is not None else ""
    return f">= {order.low} ({values[order.low]}" + (", its default)" if order.low not in written else ")") + off


def error(order: Order, values: Mapping[str, Any], written: set[str]) -> str:
    """The one line refusing ``values`` that break ``order``: the key the user wrote (``written``: the keys given
    in the file or as flags, away from their defaults), what it must be and, when the other key was left at its
    default, what to set that to: ``admission_pause_start_ratio: must be >= admission_pause_stop_ratio (0.2, its
    default) or 0, got 0.125: set admission_pause_stop_ratio to at most 0.125 as well``."""
    key = named(order, written)
    line = f"{key}: must be {allowed(order, values, written)}, got {values[key]}"
    other = order.low if key == order.high else order.high
    if other not in written:
        line += f": set {other} to {'at most' if other == order.low else 'at least'} {values[key]} as well"
    return line


def unchecked(orders: tuple[Order, ...], name: str, values: Mapping[str, Any], written: set[str],
              gates: Mapping[str, str | None]) -> str | None:
    """What key ``name`` must be when a rule of ``orders`` that its feature being off leaves unchecked would
    refuse it (the key the refusal would name), else None."""
    for order in orders:
        if named(order, written) == name and not applies(order, values, gates) and broken(order, values):
            return allowed(order, values, written)
    return None


__all__ = ["Order", "allowed", "applies", "broken", "error", "named", "unchecked"]
