"""Parallelism over torch.distributed: layout (who owns what), process groups, collectives, model sharding
(tensor and expert parallel), context parallelism for one long prompt's prefill (``context``,
``context_model``), Layer Split of the MLA cache (``layer_split``) and the sizing verb (``flashinfra plan``)."""
