"""Faults: the one grammar every injected fault is written in, and the faults the room itself makes (no torch).

spec      the grammar `WHO@WHEN:ACTION` (Place, Fault, parse_fault, parse_faults), the benchmark flags' shorter
          spellings (parse_flag: --kill, --partition, --slow) and run.slowdown's keys (run_slowdown), all one Fault
chaos     the chaos generator: `SEED:MTBF_S` (Chaos) and the Faults it draws (draw_schedule)
slowdown  run.slowdown's spell, done by a rank itself after each step (SlowSpell)

Who does them: a replica at its fault points (hsdp/sync/elastic/faults.py, elastic.faults), the slow-link benchmark
to a node's namespace (hsdp/bench/elastic.py, chaos.py), a rank's own loop (train.py, slowdown.py).
"""
