"""Disaggregated serving, the engine side: describing, packing and checking a request's cache state, moving it
between engines (ZeroMQ, Mooncake, CUDA IPC / shared memory), and the prefill, decode and encode roles."""
