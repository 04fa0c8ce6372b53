"""DeepSpeed ZeRO engines as dckpt trees, shared by the adapters that run DeepSpeed
(:mod:`dckpt.integrations.deepspeed`, the Trainer's and Accelerate's): where each rank
holds each parameter (:mod:`.layout`, pure), a live engine's parameters, flats and state
(:mod:`.view`), a parameter's ranges as one stored tensor (:mod:`.fragments`), the tree
of a save and the load target shaped after a saved one (:mod:`.tree`), and the load
into an engine of any size and stage (:mod:`.restore`). Imports no DeepSpeed module at
import time."""
