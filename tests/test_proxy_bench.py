"""kvgate bench-proxy: the summary arithmetic, wrk's output, and one tiny real run (nginx, smg, kvgate, wrk)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvgate.bench import proxy_bench
from kvgate.bench.proxy_report import Sample, markdown, summarise


def test_summary_takes_medians_then_subtracts_the_hop_in_front():
    samples = []
    # three rounds; one noisy round per arm must not move the median
    for rnd, (d, s, k) in enumerate([(10, 110, 160), (12, 500, 170), (11, 120, 900)]):
        samples += [Sample(rnd, "direct", "small", "latency", p50_us=d),
                    Sample(rnd, "smg", "small", "latency", p50_us=s, cpu_us_per_req=100),
                    Sample(rnd, "kvgate-off", "small", "latency", p50_us=k, cpu_us_per_req=300 + rnd),
                    Sample(rnd, "kvgate-nosmg", "small", "latency", p50_us=d + 40 + rnd),
                    Sample(rnd, "smg", "small", "throughput", rps=1000 + rnd, cpu_us_per_req=200, errors=rnd)]
    out = summarise(samples)
    assert out.rounds == 3 and out.errors == 3
    assert out.latency["small"] == {"direct": 11, "smg": 120, "kvgate-off": 170, "kvgate-nosmg": 53}
    # per-round differences, then the median: smg 100, 488, 109; kvgate-off 50, -330, 780; nosmg vs direct 40-42
    assert out.added["small"] == {"smg": 109, "kvgate-off": 50, "kvgate-nosmg": 41}
    assert out.latency_cpu["small"] == {"smg": 100, "kvgate-off": 301}
    assert out.ratio["small"]["kvgate-off"] == pytest.approx(50 / 109)
    assert out.rps["small"]["smg"] == 1001 and out.cpu["small"]["smg"] == 200
    md = markdown(out)
    assert "| small /generate, p50 | 109 us | 50 us (0.46x) | 41 us (0.38x) |" in md
    # each round's own ratio (smg added 100, 488, 109): kvgate-off 0.50, -0.68, 7.16; nosmg 0.40, 0.08, 0.39
    assert out.ratio_range["small"]["kvgate-off"] == pytest.approx((-330 / 488, 780 / 109))
    assert out.ratio_range["small"]["kvgate-nosmg"] == pytest.approx((41 / 488, 40 / 100))
    assert "| small /generate, p50 x smg's, lowest-highest round | - | -0.68 to 7.16x | 0.08 to 0.40x |" in md
    assert "| small /generate, max req/s (CPU/req) | 1,001 (200 us) | - | - |" in md
    assert "| small /generate, CPU/req at 1 connection | 100 us | 301 us (3.01x) | - |" in md


def test_parse_wrk_output():
    text = """Running 1s test @ http://127.0.0.1:1/generate
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   150.00us   20.00us   1.00ms   90.00%
  Latency Distribution
     50%  142.00us
     75%  150.00us
     90%  170.00us
     99%    1.02ms
  6543 requests in 1.00s, 1.00MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   6540.12
Transfer/sec:      1.00MB
"""
    r = proxy_bench.parse_wrk(text)
    assert r == {"p50_us": 142.0, "requests": 6543.0, "rps": 6540.12, "errors": 3.0}
    assert proxy_bench.parse_wrk(text.replace("142.00us", "1.50ms"))["p50_us"] == 1500.0
    with pytest.raises(ValueError):
        proxy_bench.parse_wrk("nothing")


def test_request_bodies_have_the_token_counts():
    for shape, n in proxy_bench.SHAPE_TOKENS.items():
        body = json.loads(proxy_bench.request_body(shape))
        assert len(body["input_ids"]) == n and body["session_id"] == f"bench-{shape}"
        assert body.get("stream", False) == (shape == "sse")
    sse = proxy_bench.sse_answer(16)
    assert sse.endswith(b"data: [DONE]\n\n") and sse.count(b"data: ") == 4


@pytest.mark.skipif(proxy_bench.missing_tools() is not None, reason=str(proxy_bench.missing_tools()))
def test_a_tiny_run_writes_a_sane_table(tmp_path):
    parser = argparse.ArgumentParser()
    proxy_bench.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--rounds", "1", "--latency-s", "1", "--throughput-s", "1",
                              "--connections", "4", "--arms", "nginx-proxy", "kvgate-off", "lifecycle+admission", "kvgate-nosmg",
                              "--shapes", "small", "sse", "--throughput-shapes", "small"])
    assert proxy_bench.run(args) == 0
    report = json.loads((tmp_path / "proxy-bench.json").read_text())
    s = report["summary"]
    assert report["arms"] == ["direct", "smg", "nginx-proxy", "kvgate-off", "lifecycle+admission", "kvgate-nosmg"]
    arms = set(report["arms"])
    assert s["errors"] == 0 and s["rounds"] == 1
    for shape in ("small", "sse"):
        lat = s["p50_us"][shape]
        # nginx-proxy is not run on SSE: smg's delayed-ACK stall would land on its connection to smg
        assert set(lat) == (arms - {"nginx-proxy"} if shape == "sse" else arms)
        # every hop costs something and nothing on loopback takes a second
        assert all(0 < v < 1e6 for v in lat.values())
        assert lat["smg"] > lat["direct"] and lat["kvgate-nosmg"] > lat["direct"]
        # nginx in front of smg relays the SSE stream and the JSON answer through (its added cost is the
        # floor of one more hop); it is compared with smg as the kvgate arms in front of smg are
        if shape == "small":
            assert lat["nginx-proxy"] > lat["direct"] and s["ratio_to_smg"][shape]["nginx-proxy"] is not None
        assert set(s["cpu_us_per_request_one_connection"][shape]) == set(lat) - {"direct"}
    rps, cpu = s["max_rps"]["small"], s["cpu_us_per_request"]["small"]
    assert set(rps) == arms
    assert all(v > 10 for v in rps.values())
    # the proxies' own CPU per request: more than nothing, less than a second; direct has no proxy
    assert set(cpu) == arms - {"direct"}
    assert all(0 < v < 1e6 for v in cpu.values())
    # every request answered: requests counted per sample
    assert all(x["requests"] > 0 for x in report["samples"])
    md = (tmp_path / "proxy-bench.md").read_text()
    assert md.count("\n| small /generate") == 5  # p50 and CPU rows for small and SSE, throughput row
    assert ("| request | smg adds | nginx-proxy adds | kvgate-off adds | lifecycle+admission adds "
            "| kvgate-nosmg adds |") in md
    assert "nginx-proxy: nginx as a reverse proxy" in md
    assert os.listdir(tmp_path) and sorted(os.listdir(tmp_path)) == ["proxy-bench.json", "proxy-bench.md"]


def _args(*argv):
    parser = argparse.ArgumentParser()
    proxy_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(proxy_bench.missing_tools() is not None, reason=str(proxy_bench.missing_tools()))
def test_waiters_mode_holds_the_requests_and_gives_the_memory_back(tmp_path):
    from kvgate.admission.gate import GIVE_BACK_AFTER_WAITERS
    n = GIVE_BACK_AFTER_WAITERS  # the smallest burst whose memory is given back
    assert proxy_bench.run(_args("--out", str(tmp_path), "--waiters", str(n))) == 0
    res = json.loads((tmp_path / "proxy-bench-waiters.json").read_text())
    assert res["waiters"] == n and res["memory_given_back"] == 1
    # the connections held cost memory, and the process was measured (not another one)
    assert 20 < res["rss_before_mib"] < res["rss_waiting_mib"] < 1000
    assert 0 < res["kib_per_waiter"] < 100


@pytest.mark.skipif(proxy_bench.missing_tools() is not None, reason=str(proxy_bench.missing_tools()))
def test_sessions_mode_opens_that_many_sessions(tmp_path):
    assert proxy_bench.run(_args("--out", str(tmp_path), "--sessions", "300")) == 0
    res = json.loads((tmp_path / "proxy-bench-sessions.json").read_text())
    assert res["sessions"] == 300 and res["sessions_before"] == 1
    assert res["counts"]["active"] == 301 and res["counts"]["dropped"] == 0
    assert 20 < res["rss_before_mib"] <= res["rss_sessions_mib"] < 1000


def test_the_sessions_script_names_distinct_sessions_with_distinct_prompts(tmp_path):
    script = tmp_path / "s.lua"
    proxy_bench.sessions_script(script, 5)
    text = script.read_text()
    assert "((counter - 1) % 5) + 1" in text and '"session_id":"bench-s' in text
    ids = text.split("'{\"input_ids\":[' .. k .. ',", 1)[1].split("]", 1)[0].split(",")
    assert len(ids) == proxy_bench.SESSION_PROMPT_TOKENS - 1


def test_errors_are_reported_by_the_run_that_had_them():
    """A run whose load generator saw errors (a proxy out of connections, say) is named in the report, so its
    figures are not read as a hop's cost."""
    samples = [Sample(0, "direct", "small", "latency", p50_us=10), Sample(0, "smg", "small", "latency", p50_us=100),
               Sample(0, "nginx-proxy", "small", "latency", p50_us=130),
               Sample(0, "nginx-proxy", "small", "throughput", rps=2000, errors=7),
               Sample(1, "nginx-proxy", "small", "throughput", rps=2100, errors=5)]
    out = summarise(samples)
    assert out.errors == 12 and out.errors_by == {"nginx-proxy small throughput": 12}
    assert out.to_json()["errors_by"] == {"nginx-proxy small throughput": 12}
    md = markdown(out)
    assert "load-generator errors: 12 (nginx-proxy small throughput: 12; those runs' figures are not a hop's cost)." in md
    assert "load-generator errors: 0." in markdown(summarise(samples[:3]))


def test_the_null_proxy_has_room_for_every_client_and_its_upstream_connection(tmp_path):
    conf = proxy_bench.null_proxy_config(8080, "127.0.0.1:9", tmp_path, connections=2500)
    assert "worker_connections 11024;" in conf and "worker_rlimit_nofile 11088;" in conf
    assert "worker_connections 4096;" in proxy_bench.null_proxy_config(8080, "127.0.0.1:9", tmp_path)
    assert "listen 127.0.0.1:8080;" in conf and "server 127.0.0.1:9;" in conf
