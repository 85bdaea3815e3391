"""docs/metrics.md says which labelled series exist at 0 from the start (before their first event) and which
appear with their first event: a fresh kvgate's /metrics must say the same."""

from prometheus_client.parser import text_string_to_metric_families

from kvgate.common.metrics import Metrics


def _samples() -> dict[tuple[str, tuple], float]:
    text = Metrics().render()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_known_labels_are_exported_at_zero_from_the_start():
    got = _samples()
    expected = {
        "agentic_kv_faults_total": ("stage", ["session", "registry", "admission", "idle_sweep", "inference",
                                                "placement", "observer"]),
        "agentic_kv_upstream_errors_total": ("kind", ["unreachable", "timeout", "cut", "protocol_error"]),
        "agentic_kv_body_features_skipped_total": ("reason", ["content_encoding", "size"]),
        "agentic_kv_session_close_total": ("reason", ["client", "admin_api", "idle", "abort", "pause"]),
        "agentic_kv_session_close_skipped_total": ("reason", ["no_kv", "elsewhere"]),
        "agentic_kv_state_backend_bypass_total": ("op", ["heartbeat", "turn", "idle", "placement", "inference",
                                                         "admission"]),
        "agentic_kv_placement_calls_total": ("outcome", ["engine", "router_fallback", "connect_retry", "router_auth",
                                                         "decode_named", "decode_name_ignored", "decode_name_refused",
                                                         "decode_unnamed"]),
        "agentic_kv_session_inference_total": ("result", ["decisive", "partial", "rerender", "prompt-only", "new",
                                                          "new-ambiguous", "unsupported", "shared", "refused"]),
    }
    for name, (label, values) in expected.items():
        for v in values:
            assert got[(name, ((label, v),))] == 0.0, (name, v)
    assert not [k for k in got if k[0] == "agentic_kv_session_close_total" and k[1][0][1] in ("explicit", "api")]
    assert not [k for k in got if k[0].startswith("agentic_kv_engine_warning")]  # appears with its first warning


def test_the_readme_and_the_metrics_doc_say_every_series_is_prefixed_agentic_kv():
    """Every series kvgate's registry exports is named agentic_kv_*, and the README (within its 120 lines), the
    metrics doc and the endpoint table say so."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    names = [f.name for f in Metrics().registry.collect()]
    assert len(names) >= 40 and [n for n in names if not n.startswith("agentic_kv_")] == []
    readme = (root / "README.md").read_text().splitlines()
    assert len(readme) <= 120
    assert [line for line in readme if "agentic_kv_" in line] == [
        "- [docs/metrics.md](docs/metrics.md) kvgate's Prometheus series at `GET /metrics`, every name prefixed "
        "`agentic_kv_`, and the Grafana dashboard"]
    assert "All kvgate series are prefixed `agentic_kv_`" in (root / "docs" / "metrics.md").read_text()
    assert "| `GET /metrics` | kvgate's Prometheus series, every name prefixed `agentic_kv_`" in \
        (root / "docs" / "configuration.md").read_text()
