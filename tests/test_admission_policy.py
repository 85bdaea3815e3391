"""Scope and protection classification (issue 3 steps 1-2: headers and configurable match rules)."""

import pytest

from kvgate.admission.policy import MatchRule, ScopeRules, classify_scope


def test_defaults_train_scope_unprotected():
    assert classify_scope("/generate", {}, {"input_ids": [1]}) == (False, True)
    assert classify_scope("/generate", None, None, ScopeRules()) == (False, True)


def test_headers_case_insensitive():
    assert classify_scope("/generate", {"x-kvgate-protected": "1"}, {}) == (True, True)
    assert classify_scope("/generate", {"X-KVGATE-SCOPE": "Eval"}, {}) == (False, False)
    assert classify_scope("/generate", [("X-Kvgate-Scope", "eval"), ("X-Kvgate-Protected", "true")], {}) == (True, False)


def test_scope_all_keeps_eval_in_scope():
    rules = ScopeRules(scope="all")
    assert classify_scope("/generate", {"X-Kvgate-Scope": "eval"}, {}, rules) == (False, True)


def test_match_rules_path_and_field():
    rules = ScopeRules.from_config(
        scope="train",
        protected=[{"path": "/generate", "field": "sampling_params.priority", "equals": [10, "high"]}],
        eval=[{"path": "/v1/*", "field": "metadata.split", "equals": "eval"}, {"field": "rid", "equals": ["eval-1"]}],
    )
    assert classify_scope("/generate", {}, {"sampling_params": {"priority": 10}}, rules) == (True, True)
    assert classify_scope("/generate", {}, {"sampling_params": {"priority": "10"}}, rules) == (True, True)
    assert classify_scope("/generate", {}, {"sampling_params": {"priority": 3}}, rules) == (False, True)
    assert classify_scope("/v1/chat/completions", {}, {"sampling_params": {"priority": 10}}, rules) == (False, True)
    assert classify_scope("/v1/chat/completions", {}, {"metadata": {"split": "eval"}}, rules) == (False, False)
    assert classify_scope("/v1/chat/completions?x=1", {}, {"metadata": {"split": "train"}}, rules) == (False, True)
    assert classify_scope("/generate", {}, {"metadata": {"split": "eval"}}, rules) == (False, True)  # path glob misses
    assert classify_scope("/generate", {}, {"rid": "eval-1"}, rules) == (False, False)


def test_headers_override_rules():
    rules = ScopeRules.from_config(protected=[{"path": "/generate"}], eval=[{"path": "/generate"}])
    assert classify_scope("/generate", {}, {}, rules) == (True, False)
    assert classify_scope("/generate", {"X-Kvgate-Protected": "0", "X-Kvgate-Scope": "train"}, {}, rules) == (False, True)


def test_field_presence_rule_and_bool_values():
    r = MatchRule.from_config({"field": "session_id"})
    assert r.matches("/generate", {"session_id": "s1"})
    assert not r.matches("/generate", {"session_id": None})
    assert not r.matches("/generate", "not a dict")
    b = MatchRule.from_config({"field": "extra.eval", "equals": True})
    assert b.matches("/x", {"extra": {"eval": True}})
    assert b.matches("/x", {"extra": {"eval": "true"}})
    assert not b.matches("/x", {"extra": {"eval": 1}})
    idx = MatchRule.from_config({"field": "messages.0.role", "equals": "system"})
    assert idx.matches("/v1/chat/completions", {"messages": [{"role": "system"}]})


def test_bad_config():
    with pytest.raises(ValueError):
        ScopeRules(scope="eval")
    with pytest.raises(ValueError):
        MatchRule.from_config({"paht": "/x"})
    with pytest.raises(ValueError):
        MatchRule.from_config(["/x"])
