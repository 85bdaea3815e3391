"""The bench's HiCache arms: engines started with SGLang's hierarchical cache, with and without kvgate."""


import pytest

from kvgate.bench.runner import expand_arms
from kvgate.bench.scenario import load_scenario
from kvgate.tools import procs

TINY = """
name: tiny-hicache
seed: 1
replicates: 1
speed: 4
engines: 1
max_total_num_tokens: 4000
arms: [hicache, hicache+lifecycle, hicache+lifecycle+admission, hicache+lifecycle+admission-program,
       hicache+lifecycle+admission-program-device]
kvgate_extra: {admission_chars_per_token: 1.0, max_response_length: 512}
workload:
  kind: agentic
  groups: 2
  group_size: 2
  task_prompt_tokens: {dist: const, value: 1500}
  turns: {dist: const, value: 3}
  observation_tokens: {dist: const, value: 300}
  output_tokens: {dist: const, value: 32}
  tool_gap_s: {dist: const, value: 1.0}
"""


def test_hicache_arms_expand_to_engines_with_the_host_tier(tmp_path):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(TINY)
    arms = {a.name: a for a in expand_arms(load_scenario(sc))}
    assert [(a.hicache, a.kvgate, a.lifecycle, a.admission, a.admission_policy, a.host_cache)
            for a in arms.values()] == [
        (True, False, False, False, "fifo", True), (True, True, True, False, "fifo", True),
        (True, True, True, True, "fifo", True), (True, True, True, True, "program", True),
        (True, True, True, True, "program", False)]


@pytest.mark.skipif(not procs.smg_installed(), reason="smg router not installed")
def test_hicache_arm_runs_and_its_engines_hold_a_host_tier(tmp_path):
    text = TINY.replace("arms: [hicache, hicache+lifecycle, hicache+lifecycle+admission, hicache+lifecycle+admission-program,\n"
                        "       hicache+lifecycle+admission-program-device]", "arms: [hicache]")
    assert "arms: [hicache]\n" in text
    from test_bench_e2e import run_scenario
    res, out = run_scenario(tmp_path, text)
    assert res["metrics"]["hicache"]["errors"] == 0 and res["metrics"]["hicache"]["requests"] == 12
    t = res["arms"]["hicache"][0]["sim_totals"]
    # --hicache-ratio 2.0 (SGLang's default) of the 4000-token pool; the working set (~4 x 2.5k) overflows the
    # device pool, so evicted prefixes come back from host memory instead of being prefilled again
    assert t["hicache_host_total_tokens"] == 8000
    assert t["hicache_backup_tokens"] > 0 and t["load_back_tokens"] > 0 and t["host_hit_tokens"] == t["load_back_tokens"]
    assert res["metrics"]["hicache"]["load_back_tokens"] == t["load_back_tokens"]
