"""The model's only door to computation.

Model code describes the math and calls these ops; which kernel runs (native instruction-set form, quant type,
torch twin, the device) is decided here, once per weight or layer when the model is built (`bind`, `Experts`), by
the Backend it is built with. The model never names a weight format or a kernel.
"""
from engine.ops.activations import QuantRows, quantize, round_for
from engine.ops.attention import attention
from engine.ops.backend import (TORCH, Backend, Int8Layouts, OpEvent, available_backends, backend_named,
                                default_backend)
from engine.ops.delta_rule import delta_rule, delta_rule_chunked, pointwise, tiled
from engine.ops.experts import Experts, moe_experts
from engine.ops.linear import Linear, Weight, bind, embedding, linear, linear_many

__all__ = [
    "TORCH", "Backend", "Experts", "Int8Layouts", "Linear", "OpEvent", "QuantRows", "Weight", "attention",
    "available_backends", "backend_named", "bind", "default_backend", "delta_rule", "delta_rule_chunked",
    "embedding", "linear", "linear_many", "moe_experts", "pointwise", "quantize", "round_for", "tiled",
]
