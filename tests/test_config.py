import re
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


def test_the_program_policy_defaults_to_the_makespan_aware_rules_in_config_and_core():
    # measured on many-programs (docs/benchmark.md): as fast as ThunderAgent's smallest/smallest and a little
    # faster than longest-idle (which has the shorter tail); the bench's `-thunder` arms keep ThunderAgent's
    from kvgate.admission.ledger import Ledger
    from kvgate.admission.program import ProgramCoordinator
    cfg = validate({})
    assert (cfg.admission_pause_victim, cfg.admission_resume_order) == ("ahead", "fifo")
    co = ProgramCoordinator(Ledger())
    assert (co.victim, co.resume) == ("ahead", "fifo")
    assert "admission_pause_victim: ahead " in (ROOT / "configs" / "kvgate.yaml").read_text()


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
    ({"agentic_program_admission": True, "admission_program_max_resident": 0},
     "admission_program_max_resident: must be >= 1 (or null: off), got 0"),
    ({"admission_program_max_resident": "auto"}, "admission_program_max_resident: expected an integer, got 'auto'"),
    ({"admission_program_max_resident": 2.5}, "admission_program_max_resident: expected an integer, got 2.5"),
    ({"admission_program_max_resident": True}, "admission_program_max_resident: expected an integer, got True"),
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


def test_the_resident_bound_from_yaml_and_flag(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("agentic_program_admission: true\nadmission_policy: program\nadmission_program_max_resident: 2\n")
    assert from_args(build_parser().parse_args(["serve", "--config", str(f)])).admission_program_max_resident == 2
    for flag, value in (("3", 3), ("null", None)):
        cfg = from_args(build_parser().parse_args(["serve", "--config", str(f), "--admission-program-max-resident",
                                                   flag]))
        assert cfg.admission_program_max_resident == value
    assert validate({}).admission_program_max_resident is None  # off by default
    with pytest.raises(ConfigError) as err:
        from_args(build_parser().parse_args(["serve", "--config", str(f), "--admission-program-max-resident", "0"]))
    assert str(err.value) == "admission_program_max_resident: must be >= 1 (or null: off), got 0"
    with pytest.raises(ConfigError) as err:
        from_args(build_parser().parse_args(["serve", "--admission-program-max-resident", "auto"]))
    assert str(err.value) == "admission_program_max_resident: expected an integer, got 'auto'"
    # set under the fifo policy it does nothing: said so
    assert validate({"agentic_program_admission": True, "admission_program_max_resident": 2}).warnings == [
        "admission_program_max_resident: set to 2, but it does nothing while admission_policy is fifo "
        "(a program policy key); --admission-policy program would enable it"]


def test_a_resume_deadline_the_wait_bound_overtakes_is_said_to_do_nothing():
    program = {"agentic_program_admission": True, "admission_policy": "program", "agentic_session_lifecycle": True}
    assert validate({**program, "admission_resume_deadline_s": 20}).warnings == []  # below the default 30 s wait
    assert validate({**program, "admission_resume_deadline_s": 30}).warnings == [
        "admission_resume_deadline_s: set to 30.0, but it does nothing while agentic_admission_max_wait_s (30 s) "
        "is not above it: a waiting turn bypasses first"]
    assert validate({**program, "admission_resume_deadline_s": 60, "agentic_admission_max_wait_s": 900}).warnings == []
    assert validate({"agentic_program_admission": True, "admission_resume_deadline_s": 20}).warnings == [
        "admission_resume_deadline_s: set to 20.0, but it does nothing while admission_policy is fifo "
        "(a program policy key); --admission-policy program would enable it"]


def test_every_program_policy_key_set_under_fifo_is_said_to_do_nothing():
    """Each key of the program policy's group (the --help section), set away from its default while the fifo
    policy admits, gets the one warning; a key added to the group without a value here fails this test."""
    from kvgate.config import KEYS, PROGRAM

    values = {"admission_pause_victim": "smallest", "admission_wait_bound": "reprefill",
              "admission_pause_start_ratio": 3.0, "admission_pause_stop_ratio": 0.1, "admission_foresee_cycles": 5.0,
              "admission_resume_order": "largest", "admission_program_overdue_multiple": 2.0,
              "admission_program_overdue_default_s": 30.0, "admission_resume_deadline_s": 10.0,
              "admission_program_max_resident": 4, "admission_host_cache": False, "admission_program_ttl_s": 60.0}
    group = {k.name for k in KEYS if k.group == PROGRAM.title}
    assert group == set(values)
    for key, value in values.items():
        warnings = validate({"agentic_program_admission": True, key: value}).warnings
        assert warnings == [f"{key}: set to {value!r}, but it does nothing while admission_policy is fifo (a program "
                            "policy key); --admission-policy program would enable it"], key


def test_an_exponent_yaml_reads_as_text_says_how_to_write_it(tmp_path):
    """PyYAML (YAML 1.1) reads 1e3 as a string: the error names the key and shows the number written with a dot,
    which it reads; a flag takes 1e3 as it is."""
    f = tmp_path / "k.yaml"
    f.write_text("agentic_program_admission: true\nadmission_policy: program\nadmission_foresee_cycles: 1e3\n")
    with pytest.raises(ConfigError) as err:
        from_args(build_parser().parse_args(["serve", "--config", str(f)]))
    assert str(err.value) == ("admission_foresee_cycles: expected a number, got '1e3' (YAML reads 1e3 as text: "
                              "write 1.0e+3)")
    for text, hint in (("1.5e3", "1.5e+3"), ("-2e-4", "-2.0e-4"), ("3.E4", "3.0e+4")):
        f.write_text(f"agentic_admission_headroom: {text}\n")
        with pytest.raises(ConfigError, match=f"write {re.escape(hint)}\\)$"):
            from_args(build_parser().parse_args(["serve", "--config", str(f)]))
        f.write_text(f"agentic_admission_headroom: {hint}\n")  # the hint is what YAML reads as a number
        assert yaml.safe_load(f.read_text())["agentic_admission_headroom"] == float(text)
    f.write_text("agentic_program_admission: true\nadmission_policy: program\nadmission_foresee_cycles: 1.0e+3\n")
    assert from_args(build_parser().parse_args(["serve", "--config", str(f)])).admission_foresee_cycles == 1000.0
    assert from_args(build_parser().parse_args(["serve", "--agentic-program-admission", "--admission-policy",
                                                "program", "--admission-foresee-cycles", "1e3"])
                     ).admission_foresee_cycles == 1000.0
    with pytest.raises(ConfigError, match=r"^admission_foresee_cycles: expected a number, got 'many'$"):
        validate({"admission_foresee_cycles": "many"})


def test_what_starts_and_stops_pausing_does_nothing_when_pausing_is_always_on():
    program = {"agentic_program_admission": True, "admission_policy": "program", "agentic_session_lifecycle": True}
    always = {**program, "admission_pause_start_ratio": 0}
    assert validate(always).warnings == []
    assert validate({**always, "admission_foresee_cycles": 5, "admission_pause_stop_ratio": 0.1}).warnings == [
        "admission_pause_stop_ratio: set to 0.1, but it does nothing while admission_pause_start_ratio is 0 (pausing "
        "is always on)",
        "admission_foresee_cycles: set to 5.0, but it does nothing while admission_pause_start_ratio is 0 (pausing "
        "is always on)"]
    assert validate({**program, "admission_foresee_cycles": 5}).warnings == []


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
    for k in KEYS:  # an on/off key shows as --[no-]name (kvgate.cli._DefaultsHelp)
        assert ("--[no-]" if k.type is bool else "--") + k.name.replace("_", "-") in help_text


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
    # the parser's reason and where the unclosed bracket opened, still in one line
    notyaml.write_text("upstream: [http://127.0.0.1:30000\nport: 1\n")
    res = subprocess.run([sys.executable, "-m", "kvgate", "check-config", str(notyaml)], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.strip() == (f"kvgate: config error: config file {notyaml} line 2: not valid YAML: while parsing "
                                  "a flow sequence expected ',' or ']', but got ':' (opened on line 1)")


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
    assert res.stderr.strip().splitlines()[-1] == (
        f"kvgate: startup error: cannot listen on 127.0.0.1:{port} (Address already in use): another process listens "
        f"there: stop it, or choose another --port")
    assert "Traceback" not in res.stderr and "never retrieved" not in res.stderr, res.stderr


def _kvgate(*argv, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "kvgate", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env=None if env is None else {**os.environ, **env})


def _one_line_error(res, line):
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [f"kvgate: config error: {line}"], res.stderr


HOST_ERROR = ("host: cannot resolve '0.0.0.0.1' (Name or service not known); expected an IP address like "
              "127.0.0.1 or 0.0.0.0, or a host name that resolves")


@pytest.mark.parametrize("command", ["check-config", "serve"])
@pytest.mark.parametrize("via", ["yaml", "flag"])
def test_a_host_that_does_not_resolve_is_one_line_naming_host(tmp_path, command, via):
    conf = tmp_path / "c.yaml"
    conf.write_text("host: 0.0.0.0.1\n" if via == "yaml" else "port: 0\n")
    host = ["--host", "0.0.0.0.1"] if via == "flag" else []
    res = _kvgate(command, "--config", str(conf), *host, "--port", "0", "--upstream", "http://127.0.0.1:9")
    _one_line_error(res, HOST_ERROR)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "localhost", ""])
def test_hosts_that_can_be_listened_on_are_accepted(host):
    assert validate({"host": host}).host == host


def _fake_tokenizers(root, body):
    """A ``tokenizers`` package on PYTHONPATH that shadows (or stands in for) the real one."""
    pkg = root / "fake" / "tokenizers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return {"PYTHONPATH": str(root / "fake")}


MISSING = "raise ImportError('No module named tokenizers')\n"
LOADS = ("class Tokenizer:\n    @staticmethod\n    def from_file(path):\n"
         "        if open(path).read() != '{}':\n            raise Exception('expected value at line 1 column 1')\n"
         "        return Tokenizer()\n")


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_tokenizer_file_that_does_not_exist_is_one_line(tmp_path, command):
    conf = tmp_path / "c.yaml"
    conf.write_text("agentic_program_admission: true\nadmission_tokenizer_file: /nonexistent/tok.json\n")
    res = _kvgate(command, "--config", str(conf), "--port", "0", "--upstream", "http://127.0.0.1:9")
    _one_line_error(res, "admission_tokenizer_file: /nonexistent/tok.json: no such file (expected a local "
                         "tokenizer.json)")


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_tokenizer_file_without_the_tokenizers_package_is_one_line(tmp_path, command):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    res = _kvgate(command, "--agentic-program-admission", "--admission-tokenizer-file", str(tok), "--port", "0",
                  "--upstream", "http://127.0.0.1:9", env=_fake_tokenizers(tmp_path, MISSING))
    _one_line_error(res, "admission_tokenizer_file: the 'tokenizers' package is not installed (pip install "
                         "tokenizers, or unset admission_tokenizer_file to estimate tokens from characters)")


def test_a_tokenizer_file_the_package_cannot_load_is_one_line_and_a_good_one_is_ok(tmp_path):
    env = _fake_tokenizers(tmp_path, LOADS)
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    res = _kvgate("check-config", "--agentic-program-admission", "--admission-tokenizer-file", str(bad), env=env)
    _one_line_error(res, f"admission_tokenizer_file: {bad}: not a tokenizer.json the 'tokenizers' package can "
                         f"load (expected value at line 1 column 1)")
    good = tmp_path / "tokenizer.json"
    good.write_text("{}")
    res = _kvgate("check-config", "--agentic-program-admission", "--admission-tokenizer-file", str(good), env=env)
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    assert res.stdout == ("(defaults): ok (upstream http://127.0.0.1:30000, session lifecycle off, "
                          "admission on)\n")
    # admission off: the key is not used, so it is not checked (as the admission ranges are not)
    res = _kvgate("check-config", "--admission-tokenizer-file", "/nonexistent/tok.json")
    assert res.returncode == 0, res.stderr


def test_help_says_what_the_flags_do():
    top = _kvgate("--help", env={"COLUMNS": "400"})
    assert top.returncode == 0, top.stderr
    assert ("    demo                replay a Mooncake trace slice through kvgate, smg and simulated engines (four by "
            "default, see --engines)") in top.stdout.splitlines()
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    engines = {a.dest: a for a in demo._actions}["engines"]
    assert engines.default is None and "default: 4 simulated" in engines.help  # the "four by default" above
    serve = _kvgate("serve", "--help", env={"COLUMNS": "400"})
    assert serve.returncode == 0, serve.stderr
    lines = serve.stdout.splitlines()
    assert ("  --http-server SERVER            The HTTP server kvgate answers its clients with: kvgate (kvgate's own, on "
            "httptools; less CPU per request and less memory per waiting connection) or aiohttp (aiohttp's "
            "general-purpose web server). (default: kvgate)") in lines
    at = lines.index("  --[no-]agentic-program-admission")
    assert lines[at + 1].strip() == (
        "Hold each generate call until the engines' KV can take it, as admission_policy says: fifo (one global "
        "queue in front of a token ledger) or program (started programs keep going, new ones wait for room). "
        "(default: false)")
    assert "  --admission-chars-per-token CHARS" in lines
    assert "as before" not in serve.stdout and "two simulated" not in top.stdout


def test_api_keys_from_a_file_or_an_environment_variable_and_errors_never_name_the_key(tmp_path, monkeypatch):
    from kvgate.config import api_key
    f = tmp_path / "k"
    f.write_text("  key-123\n")
    assert api_key(validate({"router_api_key_file": str(f)}), "router") == "key-123"
    monkeypatch.setenv("KVGATE_K", "env-key")
    assert api_key(validate({"engine_api_key_env": "KVGATE_K"}), "engine") == "env-key"
    assert api_key(validate({}), "router") is None
    assert "key-123" not in repr(validate({"router_api_key_file": str(f)}).as_dict())  # the config holds the path
    bad = tmp_path / "bad"
    bad.write_text("two words\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    monkeypatch.setenv("KVGATE_EMPTY", "")
    for raw, start in [({"router_api_key_file": str(tmp_path / "missing")}, "router_api_key_file: cannot read"),
                       ({"router_api_key_file": str(empty)}, "router_api_key_file: "),
                       ({"engine_api_key_file": str(bad)}, "engine_api_key_file: the key holds a space"),
                       ({"router_api_key_env": "KVGATE_UNSET_VAR"}, "router_api_key_env: the environment variable"),
                       ({"engine_api_key_env": "KVGATE_EMPTY"}, "engine_api_key_env: the environment variable"),
                       ({"router_api_key_file": str(f), "router_api_key_env": "KVGATE_K"},
                        "router_api_key_file: set either")]:
        with pytest.raises(ConfigError) as err:
            validate(raw)
        assert str(err.value).startswith(start), str(err.value)
        assert "two words" not in str(err.value) and "env-key" not in str(err.value)


def test_an_address_not_on_this_machine_is_a_host_error_in_one_line():
    """``--host`` an address no interface has (EADDRNOTAVAIL): the line says to choose another --host."""
    res = subprocess.run([sys.executable, "-m", "kvgate", "serve", "--host", "10.99.99.99", "--port", "0",
                          "--upstream", "http://127.0.0.1:9"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "kvgate: startup error: cannot listen on 10.99.99.99:0 (Cannot assign requested address): no interface of "
        "this machine has that address: choose another --host")
