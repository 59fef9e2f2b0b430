"""Benchmarks (``python -m symmring bench <name>``). `protocol`: publish->observe latency and slot-pull
bandwidth of the device protocol on the nvshmem backend."""
