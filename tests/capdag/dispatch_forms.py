#!/usr/bin/env python3
"""What capdag 1.524.58's own matcher (tagged-urn 1.138.43) says about the optional and negated
tag forms, for every pairing of candidate and request.

For each tag form F among: none, `x`, `?x`, `!x`, `x=v`, `x=w`, `x?=v`, `x!=v`, `x="*"`, `x=*`,
`x=?`, `x=!`, a cap `cap:in=media:text;out=media:text;op=t;F` is built as candidate and as
request, and capdag's `CapUrn.is_dispatchable` is asked about each of the 144 pairs. The
answers go to `core/tests/data/cap/capdag_dispatch_forms.json` beside tether's own (the seed's
truth table, docs/spec/switch.md §4), which `core/tests/cap_golden.rs` checks; where the two
differ, docs/spec/switch.md §4.6 says why.

Run with the interpreter capdag is installed in:

    /tmp/capdag-venv/bin/python tests/capdag/dispatch_forms.py
"""

import json
from importlib import metadata
from pathlib import Path

from capdag.urn.cap_urn import CapUrn

FORMS = ["", "x", "?x", "!x", "x=v", "x=w", "x?=v", "x!=v", 'x="*"', "x=*", "x=?", "x=!"]
BASE = "cap:in=media:text;out=media:text;op=t"
OUT = Path(__file__).resolve().parents[2] / "core" / "tests" / "data" / "cap" / "capdag_dispatch_forms.json"


def cap(form: str) -> str:
    return BASE + (";" + form if form else "")


def main() -> None:
    cases = []
    for candidate in FORMS:
        for request in FORMS:
            served = CapUrn.from_string(cap(candidate)).is_dispatchable(CapUrn.from_string(cap(request)))
            cases.append({"candidate": cap(candidate), "request": cap(request), "capdag": served})
    about = (
        f"capdag {metadata.version('capdag')} CapUrn.is_dispatchable over the optional and negated "
        "tag forms (tests/capdag/dispatch_forms.py); `tether_differs` marks where tether, keeping "
        "the seed's truth table, answers otherwise (docs/spec/switch.md §4.6)"
    )
    existing = {}
    if OUT.exists():
        for case in json.loads(OUT.read_text())["cases"]:
            existing[(case["candidate"], case["request"])] = case.get("tether_differs", False)
    for case in cases:
        case["tether_differs"] = existing.get((case["candidate"], case["request"]), False)
    OUT.write_text(json.dumps({"about": about, "cases": cases}, indent=1) + "\n")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
