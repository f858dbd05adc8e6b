"""Attention kernels: the prefix attention the replays and captures call (`attention.py`), the fused ops it picks per
device and dtype (`fused.py`), and the plain references the parity tests hold them to (`naive.py`)."""
