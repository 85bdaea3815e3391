import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.cli import build_parser
from kvgate.config import KEYS, ConfigError, from_args, validate

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_have_both_features_off():
    cfg = validate({})
    assert cfg.agentic_session_lifecycle is False
    assert cfg.agentic_program_admission is False
    assert cfg.session_idle_close_s == 300.0
    assert cfg.close_timeout_s == 0.5 and cfg.close_retries == 10 and cfg.close_concurrency == 8
    assert cfg.max_body_bytes == 512 * 1024 * 1024
    assert cfg.decode_cap == 4096


def test_shipped_config_documents_every_key_and_is_valid():
    text = (ROOT / "configs" / "kvgate.yaml").read_text()
    data = yaml.safe_load(text)
    assert set(data) == {k.name for k in KEYS}
    for line in text.splitlines():
        if line and not line.startswith((" ", "#")):
            assert "#" in line, f"undocumented key line: {line}"
    validate(data)


@pytest.mark.parametrize("raw, message", [
    ({"bogus": 1}, "bogus: unknown key"),
    ({"port": "eighty"}, "port: expected an integer"),
    ({"port": 70000}, "port: must be 0..65535"),
    ({"session_idle_close_s": -1}, "session_idle_close_s: must be >= 0"),
    ({"agentic_program_admission": True, "agentic_admission_headroom": 0}, "agentic_admission_headroom: must be in (0, 1]"),
    ({"agentic_program_admission": True, "agentic_admission_max_wait_s": -2}, "agentic_admission_max_wait_s: must be >= 0"),
    ({"agentic_admission_scope": "eval"}, "agentic_admission_scope: must be one of train, all"),
    ({"upstream": "localhost:30000"}, "upstream: expected an http(s) URL"),
    ({"engines": ["http://a:1", 3]}, "engines: must be a list of URL strings"),
    ({"agentic_session_lifecycle": "yes"}, "agentic_session_lifecycle: expected a boolean"),
    ({"session_field": "rid", "session_field_regex": "(unclosed"}, "session_field_regex: not a valid regular expression"),
    ({"session_field_regex": "^(.+)$"}, "session_field_regex: needs session_field"),
    ({"session_idle_close_s": float("inf")}, "session_idle_close_s: expected a finite number"),
    ({"session_placement": "smart"}, "session_placement: must be one of auto, kvgate, router"),
    ({"session_placement_routes": {"/v1/responses": "kvgate"}}, "session_placement_routes: must be a mapping from"),
    ({"session_placement_routes": {"/generate": "yes"}}, "session_placement_routes: must be a mapping from"),
    ({"session_placement_routes": ["/generate"]}, "session_placement_routes: expected a mapping"),
    ({"placement_pressure_threshold": 0}, "placement_pressure_threshold: must be in (0, 1]"),
    ({"placement_reopen_hint_s": -1}, "placement_reopen_hint_s: must be >= 0"),
])
def test_bad_values_name_the_key_in_one_line(raw, message):
    with pytest.raises(ConfigError) as err:
        validate(raw)
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_admission_ranges_only_checked_when_admission_is_on():
    assert validate({"agentic_admission_headroom": 5}).agentic_admission_headroom == 5.0
    with pytest.raises(ConfigError):
        validate({"agentic_admission_headroom": 5, "agentic_program_admission": True})


def test_flags_override_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 9000\nagentic_session_lifecycle: true\nsession_idle_close_s: 10\n")
    args = build_parser().parse_args(["serve", "--config", str(f), "--port", "9100",
                                      "--no-agentic-session-lifecycle", "--engines", "http://e1:1@0", "http://e1:1@1"])
    cfg = from_args(args)
    assert cfg.port == 9100
    assert cfg.agentic_session_lifecycle is False
    assert cfg.session_idle_close_s == 10.0
    assert cfg.engines == ["http://e1:1@0", "http://e1:1@1"]


def test_placement_route_overrides_from_yaml_and_flag(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("session_placement: router\nsession_placement_routes: {/generate: kvgate}\n")
    cfg = from_args(build_parser().parse_args(["serve", "--config", str(f)]))
    assert (cfg.session_placement, cfg.session_placement_routes) == ("router", {"/generate": "kvgate"})
    cfg = from_args(build_parser().parse_args(["serve", "--session-placement-routes", "{/v1/completions: router}"]))
    assert cfg.session_placement_routes == {"/v1/completions": "router"} and cfg.session_placement == "auto"


def test_bad_rule_flag_is_one_line(tmp_path):
    args = build_parser().parse_args(["serve", "--admission-protected-rules", "not: [valid"])
    with pytest.raises(ConfigError) as err:
        from_args(args)
    assert str(err.value).startswith("admission_protected_rules: not valid YAML")
    args = build_parser().parse_args(["serve", "--admission-eval-rules", "[{path: /generate, colour: red}]"])
    with pytest.raises(ConfigError) as err:
        from_args(args)
    assert str(err.value).startswith("admission_eval_rules: unknown match rule keys: ['colour']")


def test_every_key_has_a_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for k in KEYS:
        assert "--" + k.name.replace("_", "-") in help_text


def test_check_config_cli_exit_codes(tmp_path):
    good = subprocess.run([sys.executable, "-m", "kvgate", "check-config", str(ROOT / "configs" / "kvgate.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    assert "ok" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("agentic_program_admission: true\nagentic_admission_pressure_threshold: 1.7\n")
    res = subprocess.run([sys.executable, "-m", "kvgate", "check-config", str(bad)], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.strip() == ("kvgate: config error: agentic_admission_pressure_threshold: must be in (0, 1], "
                                  "got 1.7")
    notyaml = tmp_path / "broken.yaml"
    notyaml.write_text("port: [1,\n")
    res = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--config", str(notyaml)], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 2 and "not valid YAML" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("http_server", ["kvgate", "aiohttp"])
def test_a_port_already_taken_stops_serve_with_one_line_and_no_traceback(http_server):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # a probe that runs while startup fails (the router answers nothing) must not leave a traceback behind
        res = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--upstream",
                              "http://127.0.0.1:9", "--http-server", http_server], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    finally:
        taken.close()
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == \
        f"kvgate: config error: port: cannot listen on 127.0.0.1:{port} (Address already in use)"
    assert "Traceback" not in res.stderr and "never retrieved" not in res.stderr, res.stderr
