"""Flat-tensor collectives under their current torch names, falling back to the older names
(``reduce_scatter_tensor`` / ``all_gather_into_tensor``) on torch releases before 2.13."""

import torch.distributed as dist

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
