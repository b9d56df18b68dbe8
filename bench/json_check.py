"""What checking a hostile JSON body costs (issue #30, item 6): the body of
1.4 M empty lists in `user` (4 MiB), through http/structuring.py's
`check_json_body` with its raw text (the scan in C that nearly every body
takes) and without it (the walk over the parsed values that a body with a
surrogate escape or deep nesting takes), best of five.

    .venv/bin/python bench/json_check.py"""

from __future__ import annotations

import json
import time

from trioserve.http.structuring import check_json_body


def best(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    for name, value in (("1.4 M empty lists", [[]] * 1_400_000), ("1 M short strings", ["ab"] * 1_000_000)):
        raw = json.dumps({"user": value}).encode()
        body = json.loads(raw)
        scan = best(lambda: check_json_body(body, raw))
        walk = best(lambda: check_json_body(body))
        parse = best(lambda: json.loads(raw))
        print(f"{name} ({len(raw) / 2**20:.1f} MiB): scan {scan * 1e3:.0f} ms, walk {walk * 1e3:.0f} ms, json.loads itself {parse * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
