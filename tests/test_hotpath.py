"""The request path does only the work a request needs: bodies parsed only when a feature reads them, token ids
counted by length, metrics children reused, lease expiry checked without walking every lease."""

from __future__ import annotations

import aiohttp
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.ledger import Ledger
from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.reservation import estimate_reservation
from kvgate.common.classify import classify
from kvgate.common.metrics import Metrics


def test_classify_skips_the_parse_when_asked():
    raw = orjson.dumps({"input_ids": [1, 2, 3]})
    assert classify("POST", "/generate", raw).body == {"input_ids": [1, 2, 3]}
    c = classify("POST", "/generate", raw, parse=False)
    assert c.body is None and c.is_generate and c.route == "/generate"


def test_token_id_prompts_are_counted_by_length():
    ids = list(range(1, 65537))
    assert estimate_reservation("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 7}},
                                expected_decode_cap=4096) == 65536 + 7
    # ends checked only: a stray value inside is SGLang's 400 to give; the reservation is the list's length
    assert estimate_reservation("/generate", {"input_ids": [1, "x", 3], "sampling_params": {"max_new_tokens": 1}},
                                expected_decode_cap=4096) == 3 + 1
    # a bool is not a token id; batches of id lists count per item
    assert estimate_reservation("/generate", {"input_ids": [True, 2], "sampling_params": {"max_new_tokens": 1}},
                                expected_decode_cap=4096) == 1 + 1
    assert estimate_reservation("/generate", {"input_ids": [[1, 2], [3, 4, 5]],
                                              "sampling_params": {"max_new_tokens": 1}},
                                expected_decode_cap=4096) == (2 + 1) + (3 + 1)
    assert estimate_reservation("/v1/completions", {"prompt": ids[:100], "max_tokens": 2},
                                expected_decode_cap=4096) == 102


async def test_features_off_relays_the_generate_body_unparsed(kvgate_factory, echo_upstream):
    raw = orjson.dumps({"input_ids": list(range(1, 9000)), "session_id": "s"})

    async def send(url):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/generate", data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200

    def spy_on(gw):
        parsed = []
        real = gw._parse_body

        def spy(request, body):
            parsed.append(real(request, body))
            return parsed[-1]
        gw._parse_body = spy
        return parsed

    gw, url = await kvgate_factory(upstream=echo_upstream.url)
    assert gw.reads_body is False
    parsed = spy_on(gw)
    await send(url)
    assert parsed == []
    assert echo_upstream.received[0]["body"] == raw
    # lifecycle on: the same request is parsed once
    gw2, url2 = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    assert gw2.reads_body is True
    parsed2 = spy_on(gw2)
    await send(url2)
    assert len(parsed2) == 1 and parsed2[0]["session_id"] == "s"
    # placement by kvgate reads the session id from the body even with lifecycle off
    gw3, _ = await kvgate_factory(upstream=echo_upstream.url, session_placement="kvgate")
    assert gw3.reads_body is True


def test_relayed_metrics_reuse_their_children():
    m = Metrics()
    for _ in range(3):
        m.relayed("/generate", "200", 0.5)
    m.relayed("other", "error", 0.25)
    assert len(m._relayed) == 2
    assert m.requests.labels("/generate", "200").value == 3
    assert m.requests.labels("other", "error").value == 1
    assert m.upstream_latency.labels("/generate").sum == 1.5
    c = m.child(m.session_inference, "new")
    assert c is m.child(m.session_inference, "new") and c is m.session_inference.labels("new")
    c.inc()
    assert m.session_inference.labels("new")._value.get() == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["/generate", "/v1/completions", "other"]),
                          st.sampled_from(["200", "503", "error"]),
                          st.one_of(st.sampled_from([0.0, 0.005, 0.01, 600.0, 1200.0, 5000.0]),
                                    st.floats(0, 3000, allow_nan=False))), max_size=30))
def test_loop_series_export_what_prometheus_client_would(events):
    """LoopCounter and LoopHistogram (no lock per request) give the exposition prometheus-client's own
    Counter and Histogram give for the same events: every sample's name, labels and value, inclusive
    bucket bounds included; only the _created timestamps differ."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvgate.common.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    oc = LoopCounter("x_requests", "help", ("route", "status"), ours)
    oh = LoopHistogram("x_latency_seconds", "help", ("route",), LATENCY_BUCKETS, ours)
    op = LoopHistogram("x_plain_seconds", "help", (), LATENCY_BUCKETS, ours)
    tc = Counter("x_requests", "help", ["route", "status"], registry=theirs)
    th = Histogram("x_latency_seconds", "help", ["route"], buckets=LATENCY_BUCKETS, registry=theirs)
    tp = Histogram("x_plain_seconds", "help", buckets=LATENCY_BUCKETS, registry=theirs)
    for route, status, v in events:
        oc.labels(route, status).inc()
        tc.labels(route, status).inc()
        oh.labels(route).observe(v)
        th.labels(route).observe(v)
        op.observe(v)
        tp.observe(v)

    def samples(reg):
        text = generate_latest(reg).decode()
        return {(f.name, f.type, f.documentation, s.name, tuple(sorted(s.labels.items()))):
                (None if s.name.endswith("_created") else s.value)
                for f in text_string_to_metric_families(text) for s in f.samples}

    assert samples(ours) == samples(theirs)


def test_lease_expiry_floor_still_reclaims_every_due_lease():
    lg = Ledger(lease_ttl_s=100.0, stale_after_s=1e6)
    lg.reconcile(ClusterSnapshot.build({"e": EngineCapacity.from_pools([(1_000_000, 0, 0.0)])}, 0.0), 0.0)
    assert lg.try_acquire("a", 10, 0.0) and lg.try_acquire("b", 10, 10.0) and lg.try_acquire("c", 10, 20.0)
    assert lg.renew("a", 50.0)  # a now expires at 150, after b (110) and c (120)
    assert lg.expire(109.0) == []
    assert lg.expire(110.0) == ["b"]
    assert lg.expire(130.0) == ["c"]
    assert lg.expire(149.0) == []
    assert lg.try_acquire("d", 10, 140.0)  # expires at 240
    assert lg.expire(150.0) == ["a"]
    assert lg.expire(239.0) == [] and lg.expire(240.0) == ["d"]
    assert lg.lease_count == 0 and lg.lease_expired_total == 4
