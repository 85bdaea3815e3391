"""Copy a bench run's figures into docs/bench: ``python scripts/save_bench.py RUN_DIR NAME``.

Writes docs/bench/NAME.json (results.json without the per-request records under ``arms``, which are large and
which the report, the tiers and scripts/fidelity_table.py do not read) and docs/bench/NAME.md (the report).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    run, name = Path(argv[0]), argv[1]
    out = Path(__file__).resolve().parents[1] / "docs" / "bench"
    data = json.loads((run / "results.json").read_text())
    data["arms"] = {arm: None for arm in data.get("arms", {})}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    shutil.copyfile(run / "report.md", out / f"{name}.md")
    print(f"wrote {out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
