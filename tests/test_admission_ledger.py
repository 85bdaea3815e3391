"""Token ledger with a hand-driven clock (issue 3 "Ledger and queue")."""

import pytest

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.ledger import Grant, Ledger, Refusal


def snap(now, engines=None, **kw):
    """engines: {url: [(capacity, used, usage), ...]}; default one engine of 10000 tokens at 10%."""
    engines = engines if engines is not None else {"http://e0": [(10_000, 1000, 0.1)]}
    return ClusterSnapshot.build({u: (EngineCapacity.from_pools(p) if p is not None else None) for u, p in engines.items()}, now)


def ledger(**kw):
    args = dict(headroom=0.9, pressure_threshold=0.92, stale_after_s=6.0, lease_ttl_s=100.0, window_s=60.0)
    args.update(kw)
    return Ledger(**args)


def test_ceiling_is_capacity_times_headroom_over_healthy_engines():
    lg = ledger()
    lg.reconcile(snap(0.0, {"a": [(10_000, 0, 0.0)], "b": [(5000, 0, 0.0), (5000, 0, 0.0)], "c": None}), 0.0)
    assert lg.ceiling == 18_000  # (10000 + 10000) x 0.9; c failed its poll
    assert lg.available_tokens == 18_000 and lg.reserved == 0


def test_pools_of_counts_the_kv_pools_of_a_place():
    lg = ledger()
    assert lg.pools_of(None) == 0  # no snapshot yet
    lg.reconcile(snap(0.0, {"a": [(10_000, 0, 0.0)], "b": [(5000, 0, 0.0), (5000, 0, 0.0)], "c": None}), 0.0)
    assert (lg.pools_of("a"), lg.pools_of("b"), lg.pools_of(("b", 1)), lg.pools_of(None)) == (1, 2, 1, 3)
    assert lg.pools_of("c") == 3  # not in the snapshot: the fleet
    lg.reconcile(snap(1.0, {"a": [(10_000, 0, 0.0)]}), 1.0)
    assert lg.pools_of(None) == 1  # counted again for the new snapshot


def test_acquire_release_figures():
    lg = ledger()
    lg.reconcile(snap(0.0), 0.0)  # ceiling 9000
    g = lg.try_acquire("t1", 4000, 1.0)
    assert isinstance(g, Grant) and g.new and g.tokens == 4000
    assert lg.reserved == 4000 and lg.available_tokens == 5000 and lg.lease_count == 1
    assert lg.reserved_utilization == pytest.approx(4000 / 9000)
    assert lg.try_acquire("t2", 5000, 1.0)  # exactly fills: reserved + tokens == ceiling is allowed
    assert lg.reserved == 9000 and lg.available_tokens == 0
    r = lg.try_acquire("t3", 1, 1.0)
    assert isinstance(r, Refusal) and r.reason == "capacity_exhausted"
    assert lg.release("t1", 2.0) == 4000
    assert lg.reserved == 5000
    assert lg.try_acquire("t3", 1, 2.0)
    assert lg.reserved == 5001


def test_leases_idempotent_per_ticket():
    lg = ledger()
    lg.reconcile(snap(0.0), 0.0)
    g1 = lg.try_acquire("t", 3000, 1.0)
    g2 = lg.try_acquire("t", 3000, 1.5)
    g3 = lg.try_acquire("t", 8000, 1.5)  # a retried acquire with other numbers still is not charged
    assert g1.new and not g2.new and not g3.new
    assert g2.lease == g1.lease == g3.lease
    assert lg.reserved == 3000 and lg.lease_count == 1
    assert lg.release("t", 2.0) == 3000
    assert lg.release("t", 2.0) == 0  # idempotent
    assert lg.release("never", 2.0) == 0
    assert lg.reserved == 0 and lg.lease_count == 0


def test_pressure_guard_before_capacity():
    lg = ledger()
    lg.reconcile(snap(0.0, {"a": [(10_000, 1000, 0.1), (10_000, 9200, 0.92)]}), 0.0)
    r = lg.try_acquire("t", 10, 1.0)
    assert isinstance(r, Refusal) and r.reason == "pressure_guard"  # worst pool 0.92 >= 0.92
    lg.reconcile(snap(2.0, {"a": [(10_000, 1000, 0.1), (10_000, 9100, 0.91)]}), 2.0)
    assert lg.try_acquire("t", 10, 2.0)  # 0.91 < 0.92
    lg.reconcile(snap(3.0, {"a": [(10_000, 1000, 0.1), (10_000, 9900, 0.99)]}), 3.0)
    # pressure wins even when capacity would also refuse
    assert lg.try_acquire("big", 100_000, 3.0).reason == "pressure_guard"
    lg.reconcile(snap(4.0, {"a": [(10_000, 0, 0.0), (10_000, 0, 0.0)]}), 4.0)
    assert lg.try_acquire("big", 18_000, 4.0).reason == "capacity_exhausted"  # 10 + 18000 > 18000
    assert lg.stats(4.0)["refused"] == {"pressure_guard": 2, "capacity_exhausted": 1, "degraded": 0}


def test_oversized_request_admitted_only_when_nothing_reserved():
    lg = ledger()
    lg.reconcile(snap(0.0), 0.0)  # ceiling 9000
    assert lg.try_acquire("small", 100, 1.0)
    r = lg.try_acquire("huge", 20_000, 1.0)
    assert isinstance(r, Refusal) and r.reason == "capacity_exhausted"
    lg.release("small", 2.0)
    g = lg.try_acquire("huge", 20_000, 2.0)
    assert isinstance(g, Grant) and g.lease.oversized
    assert lg.reserved == 10_000 and lg.available_tokens == 0  # clamped to what the engine can hold
    assert lg.reserved_utilization == pytest.approx(10_000 / 9000)
    assert lg.try_acquire("next", 1, 2.0).reason == "capacity_exhausted"
    lg.release("huge", 3.0)
    assert lg.reserved == 0


def test_degraded_without_snapshot_and_when_stale():
    lg = ledger(stale_after_s=6.0)
    assert lg.is_degraded(0.0)
    assert lg.try_acquire("t", 1, 0.0).reason == "degraded"
    lg.reconcile(snap(10.0), 10.0)
    assert not lg.is_degraded(10.0)
    assert not lg.is_degraded(15.999)
    assert lg.is_degraded(16.0)  # age >= stale_after_s
    assert lg.degraded_at() == 16.0
    lg.reconcile(snap(16.5), 16.5)
    assert not lg.is_degraded(17.0)
    lg.invalidate()
    assert lg.is_degraded(17.0) and lg.ceiling == 0


def test_snapshot_without_healthy_engines_is_degraded():
    lg = ledger()
    lg.reconcile(snap(0.0, {"a": None, "b": None}), 0.0)
    assert lg.is_degraded(0.0) and lg.ceiling == 0


def test_older_snapshot_ignored():
    lg = ledger()
    lg.reconcile(snap(10.0), 10.0)
    assert lg.reconcile(snap(5.0, {"x": [(1, 0, 0.0)]}), 10.0) is False
    assert lg.ceiling == 9000 and lg.snapshot.taken_at == 10.0


def test_epoch_increments_only_when_healthy_set_changes():
    lg = ledger()
    assert lg.epoch == 0
    assert lg.reconcile(snap(0.0, {"a": [(1000, 0, 0.0)]}), 0.0) is True
    assert lg.epoch == 1
    assert lg.reconcile(snap(1.0, {"a": [(1000, 500, 0.5)]}), 1.0) is False  # same set, new numbers
    assert lg.epoch == 1
    lg.reconcile(snap(2.0, {"a": [(1000, 0, 0.0)], "b": [(1000, 0, 0.0)]}), 2.0)
    assert lg.epoch == 2 and lg.ceiling == 1800
    lg.reconcile(snap(3.0, {"a": [(1000, 0, 0.0)], "b": None}), 3.0)  # b's poll failed
    assert lg.epoch == 3 and lg.ceiling == 900
    lg.reconcile(snap(4.0, {"a": [(1000, 0, 0.0)], "b": None}), 4.0)
    assert lg.epoch == 3


def test_leases_survive_epoch_change_and_carry_epoch():
    lg = ledger()
    lg.reconcile(snap(0.0, {"a": [(10_000, 0, 0.0)], "b": [(10_000, 0, 0.0)]}), 0.0)
    g = lg.try_acquire("t", 9_500, 0.0)
    assert g.lease.epoch == 1
    lg.reconcile(snap(1.0, {"a": [(10_000, 0, 0.0)]}), 1.0)
    assert lg.epoch == 2 and lg.ceiling == 9000
    assert lg.reserved == 9_500 and lg.available_tokens == 0
    assert lg.try_acquire("u", 1, 1.0).reason == "capacity_exhausted"


def test_ttl_reclaims_stranded_leases():
    lg = ledger(lease_ttl_s=100.0, stale_after_s=1000.0)
    lg.reconcile(snap(0.0), 0.0)
    assert lg.try_acquire("a", 1000, 0.0)
    assert lg.try_acquire("b", 2000, 50.0)
    assert lg.next_expiry() == 100.0
    assert lg.expire(99.999) == []
    assert lg.expire(100.0) == ["a"]
    assert lg.next_expiry() == 150.0  # exact again after expire()
    assert lg.reserved == 2000 and lg.lease_expired_total == 1
    assert lg.release("a", 100.0) == 0  # late release of a reclaimed lease is a no-op
    assert lg.renew("b", 120.0)
    assert lg.next_expiry() == 150.0  # a lower bound (renewed to 220): the timer wakes, finds none, looks again
    assert lg.expire(150.0) == []
    assert lg.next_expiry() == 220.0
    assert lg.expire(220.0) == ["b"]
    assert lg.reserved == 0 and lg.lease_expired_total == 2 and lg.lease_count == 0
    assert not lg.renew("b", 230.0)


def test_usage_window_mean_and_max():
    lg = ledger(window_s=10.0)
    assert lg.usage_window(0.0) is None
    lg.reconcile(snap(0.0, {"a": [(1000, 200, 0.2), (1000, 600, 0.6)]}), 0.0)  # mean 0.4, worst 0.6
    lg.reconcile(snap(5.0, {"a": [(1000, 100, 0.1), (1000, 100, 0.1)]}), 5.0)  # mean 0.1, worst 0.1
    mean, mx = lg.usage_window(5.0)
    assert mean == pytest.approx(0.25) and mx == pytest.approx(0.6)
    mean, mx = lg.usage_window(10.5)  # first sample left the window
    assert mean == pytest.approx(0.1) and mx == pytest.approx(0.1)
    s = lg.stats(10.5)
    assert s["kv_token_usage_mean"] == pytest.approx(0.1) and s["kv_token_usage_max"] == pytest.approx(0.1)


def test_stats_keys():
    lg = ledger()
    lg.reconcile(snap(0.0), 0.0)
    lg.try_acquire("t", 900, 0.0)
    s = lg.stats(1.0)
    assert s["ceiling"] == 9000 and s["reserved"] == 900 and s["available_tokens"] == 8100
    assert s["reserved_utilization"] == pytest.approx(0.1) and s["lease_count"] == 1
    assert s["lease_expired"] == 0 and s["epoch"] == 1 and s["degraded"] is False
    assert s["snapshot_age_s"] == 1.0 and s["healthy_engines"] == ["http://e0"]


@pytest.mark.parametrize(
    "kw",
    [
        {"headroom": 0},
        {"headroom": 1.1},
        {"pressure_threshold": 0},
        {"pressure_threshold": 1.5},
        {"stale_after_s": 0},
        {"lease_ttl_s": -1},
        {"window_s": 0},
    ],
)
def test_bad_config(kw):
    with pytest.raises(ValueError):
        ledger(**kw)


def test_bad_tokens():
    lg = ledger()
    lg.reconcile(snap(0.0), 0.0)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            lg.try_acquire("t", bad, 0.0)
