"""`python -m cost_model {simulate, calibrate, symbols} ...` (simulate is the default)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in ("simulate", "calibrate", "symbols") else "simulate"
    if command == "calibrate":
        from cost_model.calibrate import main as calibrate_main

        return calibrate_main(args)
    if command == "symbols":
        from cost_model.symbols import table

        print(table())
        return 0
    from cost_model.simulate import main as simulate_main

    return simulate_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
