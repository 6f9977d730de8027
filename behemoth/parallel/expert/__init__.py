"""Expert parallelism: MoE experts spread over the `ep` ranks, tokens (or experts) moved between them.

    ep = apply_expert_parallel(model, EPComm.of(ep_group), ExpertPolicy("alltoall"), layers=lm.moe_layers, tp=tp_comm)
    ep.is_expert(name)          # expert weights: gradients synchronised over dp only
    ep.set_layout("gather")     # switch layouts between steps (Tutel); adapt.py chooses by probe or cost model

layout.py (a rank's part of a stacked expert weight, checkpoint views), comm.py (all-to-all and expert gather as
autograd functions), dispatch.py (the two layouts), apply.py (apply_expert_parallel), adapt.py (run-time choice).
"""

from behemoth.parallel.expert.apply import LAYOUTS, ExpertParallel, ExpertPolicy, apply_expert_parallel, plan_expert_parallel
from behemoth.parallel.expert.comm import EPComm
from behemoth.parallel.expert.layout import EXPERT_LAYOUT, ExpertShard

__all__ = ["EPComm", "EXPERT_LAYOUT", "ExpertParallel", "ExpertPolicy", "ExpertShard", "LAYOUTS", "apply_expert_parallel", "plan_expert_parallel"]
