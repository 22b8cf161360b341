"""The model's only door to computation.

Model code describes the math and calls these ops; which kernel runs (native instruction-set form, quant type,
torch twin, the device) is decided here, once per weight or layer when the model is built (`bind`, `bind_experts`), by
the Backend it is built with. The model never names a weight format or a kernel.
"""
from engine.ops.activations import QuantRows, quantize, round_for
from engine.ops.attention import Positions, attention, kv_write, rope_rows
from engine.ops.backend import (TORCH, TRITON, Backend, Int8Layouts, OpEvent, available_backends, backend_named,
                                default_backend)
from engine.ops.draft_head import draft_logits, draft_read_bytes, prepare_draft_logits, sketch_bytes
from engine.ops.delta_rule import delta_rule, delta_rule_chunked, gdn_inputs, pointwise, tiled
from engine.ops.elementwise import sigmoid_gate, silu, silu_mul
from engine.ops.experts import Experts, MoEOut, Shared, bind_experts, moe_experts, moe_ffn, moe_route
from engine.ops.layer import (AttentionSpec, DenseSpec, FusedLayer, FusedStep, GDNSpec, LayerSpec, MoESpec, fuse_layer,
                              fuse_mtp_step, fuse_step, link_layers)
from engine.ops.linear import Linear, Weight, bind, embedding, linear, linear_many, swiglu
from engine.ops.norms import l2_norm, rms_norm, rope
from engine.ops.token_mask import mask_logits, masked_argmax

__all__ = [
    "AttentionSpec", "DenseSpec", "FusedLayer", "FusedStep", "GDNSpec", "LayerSpec", "MoESpec", "fuse_layer", "fuse_mtp_step", "fuse_step",
    "link_layers",
    "Positions", "TORCH", "TRITON", "Backend", "Experts", "Int8Layouts", "Linear", "MoEOut", "OpEvent", "QuantRows", "Shared", "Weight",
    "attention", "available_backends", "backend_named", "bind", "bind_experts", "default_backend", "delta_rule", "delta_rule_chunked",
    "draft_logits", "draft_read_bytes", "prepare_draft_logits", "sketch_bytes",
    "embedding", "gdn_inputs", "mask_logits", "masked_argmax", "kv_write", "l2_norm", "linear", "linear_many", "moe_experts", "moe_ffn", "moe_route", "pointwise", "quantize",
    "rms_norm", "rope", "rope_rows", "round_for", "sigmoid_gate", "silu", "silu_mul", "swiglu", "tiled",
]
