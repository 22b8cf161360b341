"""MTP speculative decoding: chained drafts, acceptance, rollback bookkeeping, depth control.

One step (DESIGN.md "Speculative decoding"): the last emitted token x_n and the trunk's hidden state feed
the MTP head, which drafts d1..dK (each draft feeds the next). One trunk pass over [x_n, d1..dK] — the
grouped, batch-invariant multi-token pass — gives K+1 logit rows and captures the GDN state after every
position. Greedy keeps the longest prefix of drafts that equal the trunk's argmax, then the trunk's own
token; sampling uses standard speculative rejection sampling, which preserves the target distribution.
The step commits the captured GDN state at the last kept position and truncates the attention KV by
length: rollback costs no recomputation.

  drafter.py  the MTP head's cache kept in step with the trunk; chained drafts
  depth.py    speculation statistics, and the draft depth each step (fixed, or auto from costs and acceptance)
  remembered.py  auto's memory kept across processes, a file per model, backend and thread count
  verify.py   acceptance (greedy, rejection sampling) and the decoding step itself: plain with a shadow probe,
              or draft → verify → commit
"""
from engine.speculative.depth import AutoMemory, DepthController, PassCosts, SpecStats
from engine.speculative.drafter import Draft, MTPDrafter
from engine.speculative.remembered import default_dir, load_memory, memory_path, save_memory
from engine.speculative.verify import SpeculativeDecoder, accept_greedy, accept_sampling

__all__ = ["AutoMemory", "DepthController", "Draft", "MTPDrafter", "PassCosts", "SpecStats", "SpeculativeDecoder",
           "accept_greedy", "accept_sampling", "default_dir", "load_memory", "memory_path", "save_memory"]
