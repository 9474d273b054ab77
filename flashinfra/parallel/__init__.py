"""Tensor and expert parallelism over torch.distributed: layout (who owns what), process groups,
collectives, model sharding and the sizing verb (``flashinfra plan``)."""
