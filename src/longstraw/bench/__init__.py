"""Benchmarks behind `longstraw bench ...`.

`memory` runs Bench B1 (DESIGN §5): peak memory and step time of every plan across group sizes, each
configuration in a fresh `worker` subprocess; `machine` describes the host every result file records.
"""
