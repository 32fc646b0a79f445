"""Single-device MoE model maths: no communication here (that lives in moepar.parallel)."""

from .cache import KVCache
from .dispatch import LocalDispatcher, LocalPlan
from .experts import FeedForward, GroupedExperts, SharedExperts
from .model import ModelConfig, Transformer
from .moe import MoE, MoEOutput, inject_aux_loss
from .mtp import MTPMicro
from .router import (ExpertChoiceRouter, RouterConfig, RouterLosses, Routing, RoutingStats,
                     TopKRouter, capacity)

__all__ = ["MoE", "MoEOutput", "inject_aux_loss", "RouterConfig", "TopKRouter",
           "ExpertChoiceRouter", "Routing", "RouterLosses", "RoutingStats", "capacity",
           "GroupedExperts", "FeedForward", "SharedExperts", "LocalDispatcher", "LocalPlan",
           "ModelConfig", "Transformer", "KVCache", "MTPMicro"]
