"""Admission: whether LongStraw runs a model (the check of its config on a tiny float64 copy, the released configs
the sweep runs on, `longstraw check`) and `load_model`, which admits what it loads."""
